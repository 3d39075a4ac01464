"""The experiment-tracker flags that `peagle train` and `peagle eval` share (docs/usage.md, "Watching a run").

:class:`TrackingOptions` holds them once; ``TrainConfig`` and ``EvalConfig`` take its fields (their
``--help`` lists them after the command's own). Only the values are checked here: whether a backend's
package is installed and its server answers is checked by ``peagle.pipeline.tracking.preflight``
before the first step. None of them changes what a step computes, so a resumed run may change
every one (``train_resume.SAFE_TO_CHANGE`` holds :data:`TRACKING_FIELDS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from peagle.schemas.errors import UserError

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
"""The backends ``--logger`` takes, each an optional extra of the package (``pip install 'peagle[NAME]'``)."""
NO_TRACKER = "none"
WANDB_MODES = ("auto", "online", "offline")


def parse_loggers(text: str | list | tuple | None) -> tuple[str, ...]:
    """``"wandb, tensorboard"`` (or a config file's list) -> ``("tensorboard", "wandb")`` (the order of
    :data:`TRACKERS`, each once); ``"none"`` or empty -> ``()``.

    Raises:
        UserError: a name that is not a backend (or ``none`` beside one).
    """
    joined = ",".join(map(str, text)) if isinstance(text, (list, tuple)) else str(text or "")
    for mark in "[]()'\" ":
        joined = joined.replace(mark, ",")
    names = [n.strip().lower() for n in joined.split(",") if n.strip()]
    if names == [NO_TRACKER] or not names:
        return ()
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise UserError(f"--logger takes a comma list of {','.join(TRACKERS)} (or {NO_TRACKER}), got {text!r}")
    return tuple(t for t in TRACKERS if t in names)


@dataclass(frozen=True, kw_only=True)
class TrackingOptions:
    """Which experiment trackers a run logs to, and their usual settings."""

    logger: str = NO_TRACKER
    """Experiment trackers to log to, a comma list of tensorboard,wandb,mlflow,trackio (or none), each
    an optional extra (pip install 'peagle[wandb]'). train logs, on rank 0 at the steps of
    metrics.jsonl: loss, learning rate, tokens/s, data wait, per-depth agreement, the acceptance-length
    estimates (training batches, held-out), bad steps, CUDA memory; the run config and store description
    once. eval logs what it measured only where its own --logger says (a run's trackers.json is shown,
    not followed), into the run's runs when it names the same store. A missing package or an
    unreachable server stops the run in one line before its first step."""

    run_name: str | None = None
    """Name of the run in the trackers. Default: the name of the run directory (--out of train)."""

    logger_dir: str | None = None
    """Where TensorBoard's event files, W&B's run files and Trackio's database go. Default: RUN_DIR/logs
    (train), OUT/logs (eval)."""

    logger_project: str = "peagle"
    """W&B and Trackio project, MLflow experiment."""

    wandb_entity: str | None = None
    """W&B entity (user or team). Default: the login's default entity."""

    wandb_mode: str = "auto"
    """`auto`: online when a W&B login exists (WANDB_API_KEY or `wandb login`), else offline, said in
    one line (`wandb sync DIR` uploads it later); `online` or `offline` as asked. WANDB_MODE, when set,
    is what auto takes."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store (http://HOST:5000, file:PATH, sqlite:///PATH). Default:
    MLFLOW_TRACKING_URI when set, else a file store in RUN_DIR/mlruns (eval: OUT/mlruns). Credentials
    in it (http://USER:PASS@HOST, ?token=T) go to MLflow as its username and password (or token),
    never into a file or a line peagle writes."""

    def check_tracking(self) -> None:
        """Normalise ``logger`` (canonical order, ``none`` when empty) and check the values.

        Raises:
            UserError: an unknown backend or W&B mode, or an empty name.
        """
        loggers = parse_loggers(self.logger)
        object.__setattr__(self, "logger", ",".join(loggers) or NO_TRACKER)
        if self.wandb_mode not in WANDB_MODES:
            raise UserError(f"--wandb-mode must be one of {'|'.join(WANDB_MODES)}, got {self.wandb_mode!r}")
        for name in ("run_name", "logger_project"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise UserError(f"--{name.replace('_', '-')} must not be empty")

    @property
    def loggers(self) -> tuple[str, ...]:
        """The backends asked for, in the order of :data:`TRACKERS`."""
        return parse_loggers(self.logger)


TRACKING_METAVARS = {"logger": ",".join(TRACKERS) + "|" + NO_TRACKER, "run_name": "NAME", "logger_dir": "DIR",
                     "logger_project": "NAME", "wandb_entity": "NAME", "wandb_mode": "|".join(WANDB_MODES),
                     "mlflow_tracking_uri": "URI"}
"""The placeholders of these flags in ``--help`` (train's and eval's)."""
TRACKING_FIELDS = frozenset(f.name for f in dataclasses.fields(TrackingOptions))
"""The field names of :class:`TrackingOptions` (safe to change on resume)."""
