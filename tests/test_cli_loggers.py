"""`peagle train --logger ...` and `peagle eval` end to end, read back with each tracker's own reader
(docs/usage.md, "Watching a run"): TensorBoard's event files, W&B's offline run file, MLflow's file
store through ``MlflowClient``, and Trackio's database where Trackio is installed (it is not in the
lock: its pillow<13 bound would move the locked pillow).

One run, killed with -9 after a checkpoint and resumed by the same command, carries the checks: every
scalar of ``metrics.jsonl`` reaches each backend at its step, in the same runs (one TensorBoard series
without repeated steps, the same W&B run id, the same MLflow run); `peagle eval` of the run adds the
measured acceptance length at the run's last step.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
from pathlib import Path

import pytest

from peagle.pipeline.tracking.scalars import record_scalars  # noqa: E402
from peagle.pipeline.tracking.tracker import read_state  # noqa: E402
from peagle.testing import tracker_readers as readers  # noqa: E402

pytest.importorskip("tensorboard", reason="the tracker extras are not installed (scripts/install_loggers.sh)")
pytest.importorskip("wandb", reason="the tracker extras are not installed (scripts/install_loggers.sh)")
pytest.importorskip("mlflow", reason="the tracker extras are not installed (scripts/install_loggers.sh)")

HAS_TRACKIO = importlib.util.find_spec("trackio") is not None
LOGGERS = "tensorboard,wandb,mlflow" + (",trackio" if HAS_TRACKIO else "")
NAMED = ("train/loss", "train/lr", "train/tokens_per_s", "train/data_wait_share", "train/bad_steps",
         "train/depth_agreement/depth_0", "held_out/loss", "held_out/depth_agreement/depth_3",
         "acceptance_length/estimate_on_training_batches", "acceptance_length/estimate_on_held_out")
"""Tags the docs promise by name."""


def env(tmp: Path) -> dict[str, str]:
    """No W&B login (so `auto` is offline), no tracking server from the environment."""
    return {"NETRC": str(tmp / "no-netrc"), "WANDB_API_KEY": "", "MLFLOW_TRACKING_URI": ""}


@pytest.fixture(scope="module")
def peagle(cli_runner):
    return lambda *args, env=None: cli_runner.run(*args, env=env, timeout=600)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama):
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.stages.train.vocab import build_draft_vocab
    from peagle.testing.chat_data import write_chat_jsonl

    root = tmp_path_factory.mktemp("cli_loggers")
    data = write_chat_jsonl(root / "chat.jsonl", 16, seed=5)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), samples_per_shard=8,
                              backend="hf", device="cpu", max_seq_len=192), echo=lambda _: None, progress=False)
    build_draft_vocab(root / "store", 200, echo=lambda _: None)
    return root / "store"


def train_args(store, target, out, *extra: str) -> list[str]:
    return ["train", "--store", store, "--target", target, "--out", out, "--max-steps", "6", "--num-layers", "1",
            "--num-depths", "4", "--token-budget", "256", "--draft-vocab-size", "200", "--warmup-steps", "1",
            "--log-every", "1", "--save-every", "2", "--eval-every", "3", "--heldout-fraction", "0.25",
            "--num-workers", "0", "--logger", LOGGERS, *extra]


def expected(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of metrics.jsonl as the trackers must hold it: {tag: [(step, value)]}."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for tag, value in record_scalars(record).items():
            series.setdefault(tag, []).append((record["step"], value))
    return series


def numbers_in(out: Path) -> int:
    """How many finite numbers metrics.jsonl holds, besides each line's step (every one must be logged)."""
    count = 0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for key, value in json.loads(line).items():
            values = value if isinstance(value, list) else [value]
            count += sum(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) * (key != "step")
    return count


def same_series(got: dict, want: dict, rel: float = 1e-6) -> None:
    assert set(got) >= set(want), sorted(set(want) - set(got))
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=rel), tag


def since(series: dict, first_step: int) -> dict:
    return {tag: [(s, v) for s, v in points if s >= first_step] for tag, points in series.items()
            if any(s >= first_step for s, _ in points)}


@pytest.fixture(scope="module")
def run(store, tiny_llama, tmp_path_factory, peagle):
    """A run killed in step 5 (after the step-4 checkpoint), then the same command again."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    args = train_args(store, tiny_llama, out)
    killed = peagle(*args, env={**env(out.parent), "PEAGLE_FAILPOINT": "train.step:5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "W&B: no login here" in killed.stderr and "logged offline" in killed.stderr, killed.stderr[-3000:]
    first = read_state(out)["backends"]
    resumed = peagle(*args, env=env(out.parent))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-2000:]
    assert read_state(out)["backends"] == first  # the same runs, continued
    return out


@pytest.mark.slow
def test_every_metric_reaches_every_backend_at_its_step_once(run):
    """TensorBoard: one series per tag, steps 1-6 once each (the killed process's events past the
    checkpoint purged), equal to metrics.jsonl (which a resumed run writes as the uninterrupted one does,
    tests/test_cli_train.py). MLflow: the same, in the run the first process made. W&B and Trackio
    write their files on their own schedule, so the killed process's points may be missing there: the
    resumed process's must all be there, in the same run."""
    want = expected(run)
    assert set(NAMED) <= set(want) and sum(map(len, want.values())) == numbers_in(run)
    assert {s for s, _ in want["train/loss"]} == set(range(1, 7))
    state = read_state(run)["backends"]

    tb = run / "logs" / "tensorboard"
    same_series(readers.tensorboard_scalars(tb), want)  # TensorBoard keeps float32
    hparams = readers.tensorboard_hparams(tb)
    assert hparams["num_depths"] == 4 and hparams["logger"] == LOGGERS and hparams["optimizer"] == "muon"
    texts = readers.tensorboard_texts(tb)
    assert {"run/config/text_summary", "run/stores/text_summary"} <= set(texts)
    assert '"num_samples"' in texts["run/stores/text_summary"]

    mlflow = readers.mlflow_run(state["mlflow"]["tracking_uri"], state["mlflow"]["run_id"])
    assert state["mlflow"]["tracking_uri"] == f"file:{(run / 'mlruns').resolve()}"
    assert mlflow["status"] == "FINISHED" and mlflow["name"] == "run"
    assert mlflow["params"]["num_depths"] == "4" and mlflow["params"]["lr"] == "0.0001"
    assert sorted(mlflow["artifacts"]) == ["peagle/config.json", "peagle/stores.json"]
    same_series(mlflow["metrics"], want, rel=1e-12)

    runs = [readers.wandb_offline_run(r) for r in sorted((run / "logs" / "wandb").glob("offline-run-*"))]
    assert len(runs) == 2 and runs[-1]["run_id"] == state["wandb"]["run_id"] and runs[-1]["name"] == "run"
    assert {r.get("run_id") for r in runs} <= {state["wandb"]["run_id"], None}
    assert runs[-1]["config"]["num_depths"] == 4 and runs[-1]["config"]["stores"][0]["num_samples"] > 0
    same_series(runs[-1]["history"], since(want, 5), rel=1e-12)

    if HAS_TRACKIO:
        trackio = readers.trackio_run(Path(state["trackio"]["dir"]) / "peagle.db", state["trackio"]["run_name"])
        assert trackio["config"]["num_depths"] == 4
        same_series(since(trackio["metrics"], 5), since(want, 5), rel=1e-12)


@pytest.mark.slow
def test_eval_logs_what_it_measured_into_the_runs_of_the_run(run, peagle):
    """Told where (its own --logger, store and directory: a received run's trackers.json is shown, not
    followed), eval continues the run's runs there: the measured figures at the run's last step."""
    proc = peagle("eval", run, "--mode", "offline", "--max-samples", "4", "--quiet", "--logger", LOGGERS,
                  "--logger-dir", run / "logs", "--mlflow-tracking-uri", f"file:{(run / 'mlruns').resolve()}",
                  env=env(run.parent))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shown, not followed" in proc.stderr
    report = json.loads((run / "eval" / "report.json").read_text())
    measured = report["offline"]["acceptance_length"]
    state = read_state(run)["backends"]
    tb = readers.tensorboard_scalars(run / "logs" / "tensorboard")
    assert tb["acceptance_length/measured_offline_chains"] == [(6, pytest.approx(measured, rel=1e-6))]
    assert [s for s, _ in tb["measured/offline/acceptance_depth_1"]] == [6]
    mlflow = readers.mlflow_run(state["mlflow"]["tracking_uri"], state["mlflow"]["run_id"])
    assert mlflow["metrics"]["acceptance_length/measured_offline_chains"] == [(6, pytest.approx(measured))]
    runs = [readers.wandb_offline_run(r) for r in sorted((run / "logs" / "wandb").glob("offline-run-*"))]
    assert len(runs) == 3 and runs[-1]["run_id"] == state["wandb"]["run_id"]
    assert any(r["summary"].get("acceptance_length/measured_offline_chains") == pytest.approx(measured) for r in runs)


@pytest.mark.slow
def test_an_unreachable_tracking_server_is_one_line_before_the_first_step(store, tiny_llama, tmp_path, peagle):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run"
    proc = peagle(*train_args(store, tiny_llama, out, "--logger", "mlflow", "--mlflow-tracking-uri",
                              f"http://127.0.0.1:{port}"), env=env(tmp_path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("peagle: error: --logger mlflow: cannot reach "
                                                   f"http://127.0.0.1:{port}/health"), proc.stderr
    assert not (out / "metrics.jsonl").exists()
