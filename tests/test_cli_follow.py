"""`peagle train --follow` beside a real `peagle extract` (issue 22), through the real CLI (each command
a process of its own, forked from the session's warm runner: peagle/testing/warm_cli.py).

Extract worker 0 of 2 commits its half of the store; a vocab is built from it (--allow-incomplete) and a
--follow training process starts on it; then extract worker 1 starts and commits the other half while
that training runs. The training process is killed mid-run (SIGKILL at a step) and started again with
the same command: it resumes and follows on until the store is complete and its steps are spent. Its
RUN_DIR/epochs.json records which shards each epoch covered; a plain run on the finished store given
that record (--epoch-shards) consumes the same shards in the same order and ends with the same losses
and the same weights.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from peagle.testing.chat_data import write_chat_jsonl
from peagle.testing.warm_cli import Result

EXTRACT = ("--samples-per-shard", "6", "--topk", "8", "--backend", "hf", "--device", "cpu", "--max-seq-len", "256")
STEPS = 40  # > 2 partial epochs (2, 3 of 4 shards) x 30 samples at most: the run sees the whole store
TIMING = ("tokens_per_s", "data_wait_share", "step_time_s")


def _ok(proc: Result) -> Result:
    assert proc.returncode == 0, proc.describe()
    return proc


def _train(store: Path, target: Path, out: Path, *extra) -> list:
    return ["train", "--store", store, "--target", target, "--out", out, "--max-steps", STEPS, "--num-layers", 1,
            "--num-depths", 3, "--token-budget", 512, "--draft-vocab-size", 200, "--lr", "2e-3", "--warmup-steps",
            2, "--log-every", 5, "--save-every", 10, "--eval-every", 25, "--heldout-fraction", "0.2",
            "--num-workers", 1, *extra]


def _metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_follow_trains_beside_a_real_extraction_resumes_after_a_kill_and_equals_its_replay(tiny_llama, tmp_path,
                                                                                           cli_runner):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 24, seed=6)
    store, run, replay = tmp_path / "store", tmp_path / "run", tmp_path / "replay"
    worker = ["extract", "--data", data, "--target", tiny_llama, "--out", store, *EXTRACT, "--num-shards", "2"]
    _ok(cli_runner.run(*worker, "--shard-index", "0", timeout=600))
    _ok(cli_runner.run("vocab", "--store", store, "--draft-vocab-size", 200, "--allow-incomplete", "--quiet"))

    follow = _train(store, tiny_llama, run, "--follow", "--follow-timeout", 600)
    killed = cli_runner.start(*follow, env={"PEAGLE_FAILPOINT": "train.step:15"})
    deadline = time.monotonic() + 600
    while not (run / "epochs.json").exists():  # training has begun on the half store
        assert killed.running and time.monotonic() < deadline, killed.wait(1).describe()
        time.sleep(0.1)
    second = cli_runner.start(*worker, "--shard-index", "1")
    killed_result = killed.wait(600)
    assert killed_result.returncode == -signal.SIGKILL, killed_result.describe()
    resumed = cli_runner.run(*follow, timeout=900)
    _ok(second.wait(600))
    _ok(resumed)
    assert "resumed from" in resumed.stderr and "frozen for this run" in resumed.stderr
    assert "warning" not in resumed.stderr.replace("warning: the evaluation", ""), resumed.stderr

    record = json.loads((run / "epochs.json").read_text())["epochs"]
    assert record[0]["began_at_step"] == 0 and record[0]["shards"] == [[0, 2]] and not record[0]["complete"]
    assert record[-1]["shards"] == [list(range(4))] and record[-1]["complete"]
    assert all(len(a["shards"][0]) <= len(b["shards"][0]) for a, b in zip(record, record[1:]))
    assert [e["epoch"] for e in record] == list(range(len(record)))

    _ok(cli_runner.run(*_train(store, tiny_llama, replay, "--epoch-shards", run / "epochs.json"), timeout=900))
    assert json.loads((replay / "epochs.json").read_text())["epochs"] == record
    assert _metrics(replay) == _metrics(run)
    final = f"checkpoints/step-{STEPS:08d}/model.pt"
    ours, theirs = torch.load(run / final), torch.load(replay / final)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
