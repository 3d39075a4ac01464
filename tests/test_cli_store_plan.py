"""A store knows its plan (issue 22): two extract workers write into one store at once and one of them dies;
`store info` shows `1 of 2`, the missing shard and the command that finishes it, `store verify` fails,
`vocab` and `train` refuse in one line naming the missing shard (unless --allow-incomplete, which says how
much is missing); the printed command completes the store; a second extract of new inputs extends the plan.
All through the real CLI (the session's warm runner, peagle/testing/warm_cli.py) on the tiny Llama target."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from peagle.testing.chat_data import write_chat_jsonl

FLAGS = ("--samples-per-shard", "10", "--topk", "8", "--backend", "hf", "--device", "cpu", "--max-seq-len", "256")


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("peagle: error: "), proc.stderr
    for needle in needles:
        assert needle in line, line
    return line


@pytest.fixture(scope="module")
def half_store(tmp_path_factory, tiny_llama, cli_runner) -> tuple[Path, Path]:
    """Workers 0 and 1 of 2 start at once; worker 1 is killed at its first forward (after registering
    the inputs, before any commit): the store holds worker 0's shard 0 of the planned 0 and 1."""
    root = tmp_path_factory.mktemp("plan")
    data = write_chat_jsonl(root / "a.jsonl", 20, seed=4)
    store = root / "store"
    jobs = [cli_runner.start("extract", "--data", data, "--target", tiny_llama, "--out", store, *FLAGS,
                             "--shard-index", str(i), "--num-shards", "2",
                             env={"PEAGLE_FAILPOINT": "extract.forward"} if i else None) for i in (0, 1)]
    results = [job.wait(600) for job in jobs]
    assert results[0].returncode == 0, results[0].stderr
    assert results[1].returncode == -signal.SIGKILL, results[1].stderr
    assert sorted(p.name for p in (store / "commits").glob("*.json")) == ["00000.json"]
    return store, data


def test_vocab_and_train_refuse_a_half_store_unless_allowed(half_store, tiny_llama, tmp_path, run_peagle):
    store, _ = half_store
    _one_line(run_peagle("vocab", "--store", store, "--draft-vocab-size", "100"),
              "is incomplete: 1 of 2 shards committed (missing: shard 1", "--allow-incomplete")
    allowed = run_peagle("vocab", "--store", store, "--draft-vocab-size", "100", "--allow-incomplete", "--quiet")
    assert allowed.returncode == 0, allowed.stderr
    assert "--allow-incomplete was given" in allowed.stderr and "50% of the planned records missing" in allowed.stderr
    assert json.loads((store / "vocab" / "draft-100.json").read_text())["shards"] == "0"
    train = ["train", "--store", store, "--target", tiny_llama, "--max-steps", "1", "--num-layers", "1",
             "--num-depths", "2", "--token-budget", "256", "--draft-vocab-size", "100", "--num-workers", "0",
             "--heldout-fraction", "0"]
    _one_line(run_peagle(*train, "--out", tmp_path / "refused"), "is incomplete", "missing: shard 1",
              "--allow-incomplete")
    assert not (tmp_path / "refused" / "checkpoints").exists()
    ran = run_peagle(*train, "--out", tmp_path / "run", "--allow-incomplete")
    assert ran.returncode == 0, ran.stderr
    assert "training on 1 of 2 shards committed" in ran.stderr and "50% of the planned records missing" in ran.stderr


def test_store_info_shows_one_of_two_the_missing_shard_and_the_command_that_finishes_it(half_store, tiny_llama,
                                                                                          tmp_path, run_peagle):
    """`store info` of the half store (a copy: this test finishes it) shows `1 of 2`, the missing shard and
    the command; `store verify` fails; the printed command completes the store; a second extract of new
    inputs extends its plan."""
    store = tmp_path / "store"
    shutil.copytree(half_store[0], store)
    info = run_peagle("store", "info", "--store", store)
    assert info.returncode == 0, info.stderr
    assert "shards       1 of 2 committed: INCOMPLETE" in info.stdout
    assert "missing      shard 1 of a.jsonl (10 of 20 planned records)" in info.stdout
    verify = run_peagle("store", "verify", "--store", store)
    assert verify.returncode == 1 and "incomplete: 1 of 2 shards committed (missing: shard 1" in verify.stderr
    lines = info.stdout.splitlines()
    command = lines[[i for i, line in enumerate(lines) if line.startswith("finish with")][0] + 1].strip()
    args = shlex.split(command)
    assert args[:2] == ["peagle", "extract"] and str(half_store[1]) in args and str(tiny_llama) in args
    finished = run_peagle(*args[1:])
    assert finished.returncode == 0, finished.stderr
    assert "1 already committed, 1 to do" in finished.stdout
    # complete: verify checks what `store info` shows (the same store_completeness of the same commit records;
    # how info shows a complete store: tests/test_cli_extract.py::test_store_layout_matches_design)
    assert run_peagle("store", "verify", "--store", store).returncode == 0
    assert run_peagle("vocab", "--store", store, "--draft-vocab-size", "100", "--quiet").returncode == 0

    more = write_chat_jsonl(tmp_path / "b.jsonl", 20, seed=5)  # new inputs: shards 2 and 3; worker 0 does 2
    extended = run_peagle("extract", "--data", half_store[1], more, "--target", tiny_llama, "--out", store, *FLAGS,
                      "--shard-index", "0", "--num-shards", "2")
    assert extended.returncode == 0, extended.stderr
    info = run_peagle("store", "info", "--store", store).stdout
    assert "shards       3 of 4 committed: INCOMPLETE" in info and "missing      shard 3 of b.jsonl" in info
    _one_line(run_peagle("vocab", "--store", store, "--draft-vocab-size", "100"), "missing: shard 3")
