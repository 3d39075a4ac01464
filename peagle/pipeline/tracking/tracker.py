"""The tracker a run logs through: its backends opened, fed from a thread of their own.

**Off the step's critical path.** The trainer hands :meth:`Tracker.log_record` the ``metrics.jsonl``
record it has just written: plain Python numbers, read from the device once for that line (the
window's one host read). The tracker only puts it on a queue; one daemon thread turns it into tags
(:mod:`.scalars`) and calls the libraries, whose writes and network calls never hold a step. A
backend that fails mid-run (a server gone) is dropped with one warning line; the run goes on, and
``metrics.jsonl`` keeps everything.

**One run per run directory.** ``RUN_DIR/trackers.json`` keeps each backend's run id (W&B's id,
MLflow's run id and store, Trackio's run name, TensorBoard's directory) and the resolved settings: a
resumed `peagle train` continues those runs, and `peagle eval` given the run (or an export of it)
logs what it measured into them (:func:`eval_plan`).
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
from peagle.pipeline.tracking.backends import BACKENDS
from peagle.pipeline.tracking.preflight import TrackingPlan, plan_tracking
from peagle.pipeline.tracking.scalars import record_scalars, report_scalars
from peagle.schemas.errors import UserError, one_line
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
        self.backends, self.say = backends, say
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
                 extras: dict[str, Any], say: Callable[[str], None] = _say) -> Tracker | None:
    """Open every backend of ``plan``, continuing the runs ``state_dir/trackers.json`` names, and write
    the file anew with their ids; None without a plan. ``start``: the step a training run goes on from
    (None for `peagle eval`, which adds to a run and purges nothing).

    Raises:
        UserError: a backend failed to open (one line naming it and why).
    """
    if plan is None:
        return None
    for note in plan.notes:
        say(note)
    saved = read_state(state_dir).get("backends", {})
    backends = []
    for name in plan.loggers:
        try:
            backends.append(BACKENDS[name](plan, start=start, saved=saved.get(name) or {}, config=config,
                                           extras=extras))
        except Exception as err:  # the library's own: name it in one line, before any work
            for opened in backends:
                opened.close(True)
            raise UserError(f"--logger {name} failed to start its run: {one_line(err, 200)}") from None
    state = {"version": STATE_VERSION, "plan": {**asdict(plan), "log_dir": str(plan.log_dir), "notes": []},
             "backends": {**saved, **{b.name: b.state for b in backends}}}
    state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(state_dir / STATE_FILE, state)
    say(f"logging to {', '.join(plan.loggers)} as run {plan.run_name!r} ({plan.log_dir})")
    return Tracker(backends, say=say)


def eval_plan(options: TrackingOptions, *, run_dir: Path | None, out: Path) -> TrackingPlan | None:
    """What `peagle eval` logs to: the run's own trackers (``RUN_DIR/trackers.json``, same settings, so the
    same runs) and any more that ``--logger`` asks for; None when neither names one. Checked now,
    before any mode runs (:func:`plan_tracking`)."""
    saved = read_state(run_dir).get("plan") or {}
    loggers = tuple(dict.fromkeys([*(saved.get("loggers") or []), *options.loggers]))
    if not loggers:
        return None
    merged = TrackingOptions(
        logger=",".join(loggers), run_name=options.run_name or saved.get("run_name"),
        logger_dir=options.logger_dir or saved.get("log_dir"), logger_project=saved.get("project") or options.logger_project,
        wandb_entity=options.wandb_entity or saved.get("wandb_entity"),
        wandb_mode=saved.get("wandb_mode") or options.wandb_mode,
        mlflow_tracking_uri=options.mlflow_tracking_uri or saved.get("mlflow_uri"))
    merged.check_tracking()
    home = run_dir if run_dir is not None else out
    return plan_tracking(merged, log_dir=home / "logs", run_name=home.name,
                         mlflow_default=f"file:{(home / 'mlruns').resolve()}")


def log_eval_report(plan: TrackingPlan | None, report: dict[str, Any], *, run_dir: Path | None, out: Path,
                    config: dict[str, Any], say: Callable[[str], None] = _say) -> None:
    """Log what a `peagle eval` report measured, at the run's last trained step (so the measured
    acceptance lengths sit at the end of the trainer's estimates), into the runs of ``plan``."""
    if plan is None:
        return
    step = last_step(run_dir)
    tracker = open_tracker(plan, state_dir=run_dir if run_dir is not None else out, start=None,
                           config={"eval": config}, extras={}, say=say)
    scalars = report_scalars(report)
    tracker.log(step, scalars)
    tracker.summarise(scalars)
    tracker.close()
    say(f"logged {len(scalars)} measured figures at step {step} to {', '.join(plan.loggers)}")


def last_step(run_dir: Path | None) -> int:
    """The last step of ``RUN_DIR/metrics.jsonl`` (0 without one)."""
    path = None if run_dir is None else Path(run_dir) / "metrics.jsonl"
    if path is None or not path.is_file():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            step = max(step, int(json.loads(line).get("step", 0)))
        except (ValueError, TypeError, AttributeError):
            continue
    return step
