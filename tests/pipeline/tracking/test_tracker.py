"""The tracker (peagle/pipeline/tracking/tracker.py) with the real libraries: records reach the
backends from the tracker's thread, a resumed run continues the same runs (TensorBoard purges what the
killed process logged past the resume point), a backend that fails mid-run is dropped with one line
while the others go on, and `peagle eval` shows the run's RUN_DIR/trackers.json without following it."""

from __future__ import annotations

import json

import pytest

from peagle.pipeline.tracking.preflight import plan_tracking
from peagle.pipeline.tracking.tracker import continued_runs, eval_plan, last_step, open_tracker, read_state
from peagle.schemas.tracking_config import TrackingOptions
from peagle.testing import tracker_readers as readers

pytest.importorskip("tensorboard", reason="the tracker extras are not installed (scripts/install_loggers.sh)")
pytest.importorskip("mlflow", reason="the tracker extras are not installed (scripts/install_loggers.sh)")


def plan(run_dir, logger="tensorboard,mlflow"):
    options = TrackingOptions(logger=logger)
    options.check_tracking()
    return plan_tracking(options, log_dir=run_dir / "logs", run_name=run_dir.name,
                         mlflow_default=f"file:{run_dir / 'mlruns'}", environ={})


def train_line(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "loss": loss, "depth_agreement": [0.5, 0.25],
            "acceptance_length_estimate": 1.5}


def test_a_resumed_run_continues_the_same_runs_and_tensorboard_drops_what_it_repeats(tmp_path):
    run = tmp_path / "run"
    said = []
    tracker = open_tracker(plan(run), state_dir=run, start=0, config={"lr": 0.1, "store": ["s"]},
                           extras={"stores": [{"path": "s"}]}, say=said.append)
    for step in range(1, 7):  # the killed process got to step 6; its last checkpoint is step 4
        tracker.log_record(train_line(step, 10.0 + step))
    tracker.close(failed=True)
    first = read_state(run)["backends"]
    tracker = open_tracker(plan(run), state_dir=run, start=4, config={"lr": 0.1}, extras={}, say=said.append)
    for step in range(5, 9):
        tracker.log_record(train_line(step, 20.0 + step))
    tracker.close()
    assert read_state(run)["backends"] == first
    assert said == [f"logging to tensorboard, mlflow as run 'run' ({run / 'logs'})"] * 2

    tb = readers.tensorboard_scalars(run / "logs" / "tensorboard")
    assert tb["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0), (7, 27.0), (8, 28.0)]
    assert [s for s, _ in tb["acceptance_length/estimate_on_training_batches"]] == list(range(1, 9))
    assert readers.tensorboard_hparams(run / "logs" / "tensorboard") == {"lr": 0.1, "store": "s"}
    mlflow = readers.mlflow_run(first["mlflow"]["tracking_uri"], first["mlflow"]["run_id"])
    assert mlflow["status"] == "FINISHED" and mlflow["params"] == {"lr": "0.1", "store": "s"}
    assert sorted({s for s, _ in mlflow["metrics"]["train/loss"]}) == list(range(1, 9))  # MLflow keeps both 5s and 6s


def test_a_backend_that_fails_mid_run_is_dropped_in_one_line_and_the_others_go_on(tmp_path):
    from mlflow import MlflowClient

    run = tmp_path / "run"
    said = []
    tracker = open_tracker(plan(run), state_dir=run, start=0, config={}, extras={}, say=said.append)
    tracker.log_record(train_line(1, 1.0))
    state = read_state(run)["backends"]["mlflow"]
    MlflowClient(tracking_uri=state["tracking_uri"]).delete_run(state["run_id"])  # its store refuses it now
    for step in (2, 3):
        tracker.log_record(train_line(step, float(step)))
    tracker.close()
    warnings = [line for line in said if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: --logger mlflow stopped logging at step ")
    assert "metrics.jsonl still has everything" in warnings[0] and "\n" not in warnings[0]
    tb = readers.tensorboard_scalars(run / "logs" / "tensorboard")
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3]


def test_eval_shows_the_runs_trackers_and_logs_only_where_it_is_told(tmp_path):
    """A received run is data: eval logs to the trackers its own --logger names, with its own defaults
    under OUT, and continues the run's backend runs only inside the destination it named."""
    run = tmp_path / "run"
    open_tracker(plan(run), state_dir=run, start=0, config={}, extras={}, say=lambda _: None).close()
    (run / "metrics.jsonl").write_text("".join(json.dumps(train_line(s, 1.0)) + "\n" for s in (10, 20)) + "{torn")
    asked = TrackingOptions()
    asked.check_tracking()
    said = []
    assert eval_plan(asked, run_dir=run, out=run / "eval", say=said.append) is None
    assert len(said) == 1 and "the run logged to tensorboard, mlflow" in said[0] and "not followed" in said[0]
    assert last_step(run) == 20 and last_step(None) == 0
    assert eval_plan(asked, run_dir=None, out=tmp_path / "report", say=said.append) is None and len(said) == 1
    more = TrackingOptions(logger="mlflow")
    more.check_tracking()
    found = eval_plan(more, run_dir=run, out=tmp_path / "report", say=said.append)
    assert found.loggers == ("mlflow",) and found.log_dir == tmp_path / "report" / "logs" and found.run_name == "run"
    assert found.mlflow_uri == f"file:{(tmp_path / 'report' / 'mlruns').resolve()}"
    assert continued_runs(found, run) == {}  # another store than the run's: a new run there
    same = TrackingOptions(logger="mlflow", mlflow_tracking_uri=f"file:{run / 'mlruns'}")
    same.check_tracking()
    found = eval_plan(same, run_dir=run, out=tmp_path / "report", say=said.append)
    assert continued_runs(found, run) == {"mlflow": read_state(run)["backends"]["mlflow"]}
