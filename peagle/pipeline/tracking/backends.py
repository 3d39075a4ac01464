"""One class per tracker library, each with the same three verbs: open (in ``__init__``), ``log`` and
``close``. The libraries are imported here, when a backend opens (never when peagle is imported).

* ``start`` is the step the run goes on from (0 for a new run): TensorBoard hides its earlier events
  past it (``purge_step``), so an exact resume leaves one series without repeated steps;
* ``saved`` is what ``RUN_DIR/trackers.json`` kept of the backend's run (its id): W&B, MLflow and
  Trackio continue that run instead of starting another; :attr:`state` is what to keep;
* ``config`` (the run's whole config) and ``extras`` (more documents: the stores' description) go in the
  form each backend shows as hyperparameters: TensorBoard's hparams (flattened) and text tab and
  MLflow's params (flattened) and JSON artifacts once, when the backend's run is new (nothing
  ``saved``: MLflow's params cannot change, and a resumed run may change its length); W&B's and
  Trackio's config on every start (a killed process's offline file may not hold it).

Each call may block on the library's I/O: the tracker calls ``log``, ``flush`` (where a backend buffers:
TensorBoard) and ``close`` from its own thread.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import uuid
from pathlib import Path
from typing import Any

from peagle.pipeline.tracking.preflight import TrackingPlan, mlflow_client_uri
from peagle.pipeline.tracking.scalars import as_json_text, flat_params
from peagle.schemas.secrets import redact_text

MLFLOW_PARAM_CHARS = 6000
"""MLflow's limit on a param value (longer ones are cut, with a warning of its own)."""
MLFLOW_BATCH = 100
"""MLflow takes at most 100 params and 1,000 metrics per log_batch call."""
HPARAM_METRICS = ("acceptance_length/estimate_on_held_out", "acceptance_length/estimate_on_training_batches",
                  "train/loss", "acceptance_length/measured_vllm", "acceptance_length/measured_own_loop")
"""The tags TensorBoard's hparams tab shows beside the hyperparameters."""


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, plan: TrackingPlan, *, start: int | None, saved: dict[str, Any], config: dict[str, Any],
                 extras: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.log_dir = plan.log_dir / "tensorboard"
        # flush_secs: the events reach the file (and a watching TensorBoard) within 10 s
        self.writer = SummaryWriter(str(self.log_dir), purge_step=None if start is None else start + 1, flush_secs=10)
        if not saved:
            for summary in hparams(flat_params(config), {tag: 0.0 for tag in HPARAM_METRICS}):
                self.writer.file_writer.add_summary(summary)
            for name, value in {"config": config, **extras}.items():
                self.writer.add_text(f"run/{name}", as_json_text(value), 0)
        self.state = {"log_dir": str(self.log_dir)}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbBackend:
    name = "wandb"

    def __init__(self, plan: TrackingPlan, *, start: int | None, saved: dict[str, Any], config: dict[str, Any],
                 extras: dict[str, Any]):
        import wandb

        run_id = saved.get("run_id") or uuid.uuid4().hex[:8]  # W&B ids: 8 of [a-z0-9], as its own
        plan.log_dir.mkdir(parents=True, exist_ok=True)
        # console off: W&B's capture of stdout/stderr would wrap peagle's progress lines; the run file is
        # written every 5 s (W&B's default 15): a killed run keeps more of its points. No metadata: W&B's
        # records the process's command line as it is, and a tracking URI's password given as a flag would
        # reach the run file and the W&B server (the redacted config is what the run shows instead)
        self.run = wandb.init(project=plan.project, entity=plan.wandb_entity, name=plan.run_name, id=run_id,
                              resume="allow", dir=str(plan.log_dir), mode=plan.wandb_mode,
                              settings=wandb.Settings(console="off", silent=True, x_transaction_log_flush_interval=5.0,
                                                      x_disable_meta=True))
        if config:  # also on a resume (W&B keeps a run's config server-side; an offline run file keeps its own)
            self.run.config.update({**config, **extras}, allow_val_change=True)
        self.state = {"run_id": run_id, "project": plan.project, "entity": plan.wandb_entity, "mode": plan.wandb_mode}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def summarise(self, scalars: dict[str, float]) -> None:
        """Also in the run's summary: a run resumed online refuses history at a step it has passed."""
        self.run.summary.update(scalars)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowBackend:
    name = "mlflow"

    def __init__(self, plan: TrackingPlan, *, start: int | None, saved: dict[str, Any], config: dict[str, Any],
                 extras: dict[str, Any]):
        assert plan.mlflow_uri is not None
        if plan.mlflow_uri.startswith("file:") or "://" not in plan.mlflow_uri:
            # MLflow 3 refuses its file store unless asked; it is the one store that needs no server or database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        # the client gets the URI without credentials; they go where it reads them (mlflow_client_uri)
        self.client = MlflowClient(tracking_uri=mlflow_client_uri(plan.mlflow_uri))
        shown_uri = redact_text(plan.mlflow_uri)  # what trackers.json keeps: never a credential
        same_store = redact_text(str(saved.get("tracking_uri") or "")) == shown_uri
        self.run_id = saved.get("run_id") if same_store else None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(plan.project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(plan.project)
            self.run_id = self.client.create_run(experiment_id, run_name=plan.run_name).info.run_id
            items = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in flat_params(config).items()]
            for i in range(0, len(items), MLFLOW_BATCH):
                self.client.log_batch(self.run_id, params=items[i:i + MLFLOW_BATCH])
            for name, value in {"config": config, **extras}.items():
                self.client.log_dict(self.run_id, value, f"peagle/{name}.json")
        self.state = {"run_id": self.run_id, "tracking_uri": shown_uri}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in scalars.items()]
        for i in range(0, len(metrics), MLFLOW_BATCH * 10):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MLFLOW_BATCH * 10])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class TrackioBackend:
    name = "trackio"

    def __init__(self, plan: TrackingPlan, *, start: int | None, saved: dict[str, Any], config: dict[str, Any],
                 extras: dict[str, Any]):
        # Trackio reads TRACKIO_DIR once, when first imported (plan_tracking sets it before its import)
        import trackio
        import trackio.utils

        self.trackio = trackio
        name = saved.get("run_name") or f"{plan.run_name}-{uuid.uuid4().hex[:6]}"
        with contextlib.redirect_stdout(io.StringIO()):  # its banner lines are not peagle's
            # the config also on a resume: a killed process may not have written its own
            self.run = trackio.init(project=plan.project, name=name, config={**config, **extras} if config else None,
                                    resume="allow", embed=False, auto_log_gpu=False, auto_log_cpu=False)
        self.state = {"run_name": name, "project": plan.project, "dir": str(trackio.utils.TRACKIO_DIR)}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # the module's finish: its exit hook then has nothing left
            self.trackio.finish()


BACKENDS = {backend.name: backend for backend in (TensorBoardBackend, WandbBackend, MlflowBackend, TrackioBackend)}

