"""The tracker a run logs through: its backends opened, fed from a thread of their own.

**Off the step's critical path.** The trainer hands :meth:`Tracker.log_record` the ``metrics.jsonl``
record it has just written: plain Python numbers, read from the device once for that line (the
window's one host read). The tracker only puts it on a queue; one daemon thread turns it into tags
(:mod:`.scalars`) and calls the libraries, whose writes and network calls never hold a step. A
backend that fails mid-run (a server gone) is dropped with one warning line; the run goes on, and
``metrics.jsonl`` keeps everything.

**One run per run directory.** ``RUN_DIR/trackers.json`` keeps each backend's run id (W&B's id,
MLflow's run id and store, Trackio's run name, TensorBoard's directory) and the resolved settings,
credentials redacted (``peagle.schemas.secrets``): a resumed `peagle train` continues those runs.

**A received run is data, not instructions.** `peagle eval` of a run (or an export of it) logs only
to the trackers its own command line (or ``--config`` file) names, writes only under its ``--out``
(TensorBoard's events, W&B's files and MLflow's default store go to OUT/logs and OUT/mlruns), and
shows what the run's ``trackers.json`` recorded without following it (:func:`eval_plan`): a moved
run, or one somebody handed over, cannot make eval write at another path or talk to another server.
The run's backend runs are continued only inside the destination the command line named (the same
MLflow store, the same W&B project and entity), so the figures still join the run they measure.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from peagle.pipeline.atomic import atomic_write_json
from peagle.pipeline.contained import inside
from peagle.pipeline.tracking.backends import BACKENDS
from peagle.pipeline.tracking.preflight import TrackingPlan, plan_tracking
from peagle.pipeline.tracking.scalars import record_scalars, report_scalars
from peagle.schemas.errors import UserError, one_line
from peagle.schemas.run_files import METRICS_FILE
from peagle.schemas.secrets import redact, redact_text
from peagle.schemas.tracking_config import TrackingOptions

STATE_FILE = "trackers.json"
STATE_VERSION = 1
FLUSH_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 120.0
"""How long closing waits for the queue to drain (a slow server); then it gives up, saying so."""


def _say(line: str) -> None:
    print(f"peagle: {line}", file=sys.stderr, flush=True)


def read_state(run_dir: Path | None) -> dict[str, Any]:
    """``RUN_DIR/trackers.json`` ({} when there is none, or it does not parse)."""
    path = None if run_dir is None else Path(run_dir) / STATE_FILE
    if path is None or not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else {}


class Tracker:
    """Open backends, a queue and the thread that feeds them (module docstring)."""

    def __init__(self, backends: list[Any], *, say: Callable[[str], None] = _say):
        self.backends = backends
        self.say = lambda line: say(redact_text(line))  # a library's error may quote a URL with credentials
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="peagle-trackers", daemon=True)
        self.thread.start()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Queue ``scalars`` at ``step`` for every backend (returns at once)."""
        if scalars:
            self.queue.put(("log", step, dict(scalars)))

    def log_record(self, record: dict[str, Any] | None) -> None:
        """Queue a ``metrics.jsonl`` record (its tags are made on the tracker's thread)."""
        if record is not None:
            self.queue.put(("record", int(record["step"]), record))

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until everything queued so far is written (the trainer calls it after each checkpoint: a
        resume purges TensorBoard's events past the checkpoint, so those up to it must be on disk)."""
        done = threading.Event()
        self.queue.put(("flush", None, done))
        if not done.wait(timeout):
            self.say(f"warning: the trackers did not write their queue within {timeout:.0f} s of the checkpoint")

    def summarise(self, scalars: dict[str, float]) -> None:
        """Queue ``scalars`` for the run summaries of the backends that keep one (W&B)."""
        self.queue.put(("summary", None, dict(scalars)))

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            kind, step, payload = item
            if kind == "flush":
                for backend in list(self.backends):
                    getattr(backend, "flush", lambda: None)()
                payload.set()
                continue
            scalars = record_scalars(payload) if kind == "record" else payload
            for backend in list(self.backends):
                try:
                    if kind != "summary":
                        backend.log(step, scalars)
                    elif hasattr(backend, "summarise"):
                        backend.summarise(scalars)
                except Exception as err:  # a library's or a server's: the run goes on without it
                    self.backends.remove(backend)
                    self.say(f"warning: --logger {backend.name} stopped logging at step {step} "
                             f"({one_line(err, 160)}); metrics.jsonl still has everything")

    def close(self, *, failed: bool = False) -> None:
        """Drain the queue, then close every backend (``failed``: mark the run as failed where the
        backend has such a mark: W&B's exit code, MLflow's status)."""
        self.queue.put(None)
        self.thread.join(CLOSE_TIMEOUT_S)
        if self.thread.is_alive():
            self.say(f"warning: the trackers did not take every metric within {CLOSE_TIMEOUT_S:.0f} s; closing them")
        for backend in self.backends:
            try:
                backend.close(failed)
            except Exception as err:
                self.say(f"warning: closing --logger {backend.name}: {one_line(err, 160)}")
        self.backends = []


def open_tracker(plan: TrackingPlan | None, *, state_dir: Path, start: int | None, config: dict[str, Any],
                 extras: dict[str, Any], say: Callable[[str], None] = _say,
                 saved: dict[str, Any] | None = None) -> Tracker | None:
    """Open every backend of ``plan``, continuing the runs ``state_dir/trackers.json`` names (or
    ``saved``'s, where given: eval's), and write the file anew with their ids; None without a plan.
    ``start``: the step a training run goes on from (None for `peagle eval`, which adds to a run and
    purges nothing). ``config`` and ``extras`` reach the backends redacted, and so does the file.

    Raises:
        UserError: a backend failed to open (one line naming it and why).
    """
    if plan is None:
        return None
    for note in plan.notes:
        say(note)
    if saved is None:
        saved = read_state(state_dir).get("backends", {})
    config, extras = redact(config), redact(extras)
    backends = []
    for name in plan.loggers:
        try:
            backends.append(BACKENDS[name](plan, start=start, saved=saved.get(name) or {}, config=config,
                                           extras=extras))
        except Exception as err:  # the library's own: name it in one line, before any work
            for opened in backends:
                opened.close(True)
            raise UserError(f"--logger {name} failed to start its run: {redact_text(one_line(err, 200))}") from None
    state = {"version": STATE_VERSION, "plan": {**asdict(plan), "log_dir": str(plan.log_dir), "notes": []},
             "backends": {**saved, **{b.name: b.state for b in backends}}}
    state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(state_dir / STATE_FILE, redact(state))
    say(f"logging to {', '.join(plan.loggers)} as run {plan.run_name!r} ({plan.log_dir})")
    return Tracker(backends, say=say)


def eval_plan(options: TrackingOptions, *, run_dir: Path | None, out: Path,
              say: Callable[[str], None] = _say) -> TrackingPlan | None:
    """What `peagle eval` logs to: the trackers its own ``--logger`` names, with its own settings and
    defaults under ``out`` (OUT/logs, OUT/mlruns); None when it names none. What the run's
    ``trackers.json`` recorded is shown in one line, never followed (module docstring). Checked now,
    before any mode runs (:func:`plan_tracking`)."""
    recorded = read_state(run_dir).get("plan") or {}
    if isinstance(recorded.get("loggers"), list) and recorded["loggers"]:
        mlflow = f" (MLflow: {_shown(recorded['mlflow_uri'])})" if recorded.get("mlflow_uri") else ""
        say(redact_text(f"note: the run logged to {_shown(', '.join(map(str, recorded['loggers'])))}{mlflow}; its "
                        f"{STATE_FILE} is shown, not followed: eval logs only where its own --logger says"
                        + ("" if options.loggers else " (none here)")))
    if not options.loggers:
        return None
    home = run_dir if run_dir is not None else out
    return plan_tracking(options, log_dir=out / "logs", run_name=home.resolve().name,
                         mlflow_default=f"file:{(out / 'mlruns').resolve()}")


def _shown(value: Any, limit: int = 160) -> str:
    """A value a run recorded, as one printable line (a received file may hold control characters)."""
    return "".join(c if c.isprintable() else "?" for c in " ".join(str(value).split()))[:limit]


def continued_runs(plan: TrackingPlan, run_dir: Path | None) -> dict[str, Any]:
    """The run's backend runs (``RUN_DIR/trackers.json``) that eval continues: only those inside the
    destination ``plan`` names (MLflow: the same store; W&B and Trackio: the same project and
    entity), so a run id is data within a place the command line chose, never a place to go."""
    recorded = read_state(run_dir)
    backends = recorded.get("backends") or {}
    out: dict[str, Any] = {}
    mlflow = backends.get("mlflow") or {}
    if plan.mlflow_uri and mlflow.get("run_id") and \
            redact_text(str(mlflow.get("tracking_uri") or "")) == redact_text(plan.mlflow_uri):
        out["mlflow"] = mlflow
    wandb = backends.get("wandb") or {}
    if wandb.get("run_id") and wandb.get("project") == plan.project and wandb.get("entity") == plan.wandb_entity:
        out["wandb"] = wandb
    trackio = backends.get("trackio") or {}
    if trackio.get("run_name") and trackio.get("project") == plan.project:
        out["trackio"] = {"run_name": trackio["run_name"]}
    return out


def log_eval_report(plan: TrackingPlan | None, report: dict[str, Any], *, run_dir: Path | None, out: Path,
                    config: dict[str, Any], say: Callable[[str], None] = _say) -> None:
    """Log what a `peagle eval` report measured, at the run's last trained step (so the measured
    acceptance lengths sit at the end of the trainer's estimates), into the runs of ``plan``; the
    state of what eval logged goes to ``out/trackers.json`` (nothing is written in the run)."""
    if plan is None:
        return
    step = last_step(run_dir)
    tracker = open_tracker(plan, state_dir=out, start=None, config={"eval": config}, extras={}, say=say,
                           saved=continued_runs(plan, run_dir))
    scalars = report_scalars(report)
    tracker.log(step, scalars)
    tracker.summarise(scalars)
    tracker.close()
    say(f"logged {len(scalars)} measured figures at step {step} to {', '.join(plan.loggers)}")


def last_step(run_dir: Path | None) -> int:
    """The last step of ``RUN_DIR/metrics.jsonl`` (0 without one)."""
    path = None if run_dir is None else inside(run_dir, METRICS_FILE, tree="run")  # a received run's link out: refused
    if path is None or not path.is_file():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            step = max(step, int(json.loads(line).get("step", 0)))
        except (ValueError, TypeError, AttributeError):
            continue
    return step
