"""recipes/slurm/*.sbatch on a real Slurm: scripts/slurm_local.sh starts a one-node cluster (munge,
slurmctld, slurmd from Debian's packages, installed when missing) for this module and stops it after.

The real recipe files are submitted as a user would (`bash recipes/slurm/extract.sbatch ...`, which
submits itself with the resources of its environment): an extract array of 3 tasks into one store on
the tiny target (HF backend, no GPU asked for), one task requeued (`scontrol requeue`) while it holds
after committing some of its shards; then recipes/slurm/train.sbatch, submitted at once with a
dependency on the extract job, trains on 2 Slurm tasks (two torchrun agents meeting over c10d, gloo).
The store must be byte-identical to one process's extraction, the weights to `torchrun
--nproc-per-node 2` without Slurm. Seconds of work once the daemons are up.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from peagle.testing.chat_data import write_chat_jsonl

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "slurm_local.sh"
EXTRACT = ("--samples-per-shard", "2", "--topk", "8", "--device", "cpu", "--batch-size", "2", "--threads", "1")
NUM_TASKS, NUM_SHARDS = 3, 12  # 24 records, 2 a shard: task i writes shards i, i + 3, i + 6, i + 9
TRAIN = ("--max-steps", "3", "--num-layers", "1", "--num-depths", "3", "--token-budget", "256",
         "--num-workers", "0", "--log-every", "1", "--heldout-fraction", "0", "--eval-every", "0", "--save-every", "0")
VOCAB_SIZE = "128"


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _wait(what: str, done, timeout: float = 300, explain=lambda: "") -> None:
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}\n{explain()}")
        time.sleep(0.2)


def _tail(path: Path, num_lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:]) if path.exists() else f"({path}: none)"


REQUEUE_GRACE_S = 10.0
"""How long after a requeue the test waits before lifting Slurm's requeue delay: lifted in the same
second, the second attempt was launched while slurmd still cleaned up the first and failed at once
(exit 1, no line in its log; seen once in CI, 2026-12-02)."""


def _start_now(env: dict[str, str], task: str, requeued_at: float) -> bool:
    """Whether ``task`` has left the queue's pending state; while it waits for Slurm's requeue delay (~2
    minutes, set when the killed attempt is cleaned up, maybe after an earlier update), lift it again,
    once the killed attempt has no step left and has had :data:`REQUEUE_GRACE_S` to end."""
    line = subprocess.run(["squeue", "-h", "-j", task, "-o", "%t %r"], capture_output=True, text=True, env=env).stdout
    if not line.startswith("PD"):
        return True
    steps = subprocess.run(["squeue", "-h", "-s", "-j", task], capture_output=True, text=True, env=env).stdout
    if "BeginTime" in line and not steps.strip() and time.monotonic() - requeued_at >= REQUEUE_GRACE_S:
        _scontrol(env, "update", f"jobid={task}", "StartTime=now")
    return False


@pytest.fixture(scope="module")
def slurm():
    """The environment that reaches the cluster (SLURM_CONF; this venv's peagle and torchrun first on PATH)."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (slurmd starts jobs as their user)")
    # not under pytest's 0700 tmp root: munged wants its socket's directory searchable by all
    cluster = Path(tempfile.mkdtemp(prefix="peagle-slurm-"))
    proc = subprocess.run(["bash", str(CLUSTER), "start", str(cluster)], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:  # apt-get could not install munge and Slurm: no registry from here
        shutil.rmtree(cluster, ignore_errors=True)
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    try:
        _ok(proc)
        yield {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "OMP_NUM_THREADS": "1",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(cluster)], timeout=60)
        shutil.rmtree(cluster, ignore_errors=True)


def _submit(recipe: str, env: dict[str, str], *args: str, cwd: Path) -> str:
    proc = _ok(subprocess.run(["bash", str(ROOT / "recipes" / "slurm" / recipe), *args], capture_output=True,
                              text=True, env=env, cwd=cwd, timeout=60))
    return re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)


def _scontrol(env: dict[str, str], *args: str) -> str:
    return _ok(subprocess.run(["scontrol", *args], capture_output=True, text=True, env=env, timeout=60)).stdout


def _queued(env: dict[str, str], job: str) -> list[str]:
    """States of the job's tasks still in the queue (PD, R, CG, ...)."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], capture_output=True, text=True, env=env).stdout
    return out.split()


def _commits(store: Path) -> set[int]:
    return {int(p.stem) for p in (store / "commits").glob("*.json")} if (store / "commits").is_dir() else set()


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file a reader may rely on (the lock files left out)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def runs(slurm, tiny_llama, tmp_path_factory):
    """Submit both recipes, requeue extract task 1 mid-run, and run the same work without Slurm beside."""
    from peagle.stages.train.vocab import build_draft_vocab

    work = tmp_path_factory.mktemp("slurm-runs")
    data = write_chat_jsonl(work / "chats.jsonl", 24, seed=0)
    store, hold = work / "store", work / "hold"
    hold.touch()  # every task holds after its first commits until this file is gone (PEAGLE_FAILPOINT_HOLD)
    extract_env = {**slurm, "TARGET": str(tiny_llama), "STORE": str(store), "NUM_TASKS": str(NUM_TASKS),
                   "BACKEND": "hf", "GPUS_PER_TASK": "0", "CPUS_PER_TASK": "1", "MEM": "1G", "TIME": "10",
                   "PEAGLE_FAILPOINT": "extract.after_commit", "PEAGLE_FAILPOINT_HOLD": str(hold)}
    extract_job = _submit("extract.sbatch", extract_env, str(data), *EXTRACT, cwd=work)
    train_env = {**slurm, "STORE": str(store), "TARGET": str(tiny_llama), "OUT": str(work / "run"),
                 "AFTER": extract_job, "VOCAB_SIZE": VOCAB_SIZE, "NODES": "1", "TASKS_PER_NODE": "2",
                 "GPUS_PER_NODE": "0", "CPUS_PER_TASK": "1", "MEM": "1G", "TIME": "10"}
    train_job = _submit("train.sbatch", train_env, *TRAIN, cwd=work)
    train_pending = _scontrol(slurm, "show", "job", train_job)

    one = work / "one"
    _extract_here(data, tiny_llama, one)  # the same extraction in one process, while the array's tasks hold
    task1 = set(range(1, NUM_SHARDS, NUM_TASKS))
    _wait("task 1's first commits", lambda: _commits(store) & task1)
    held_commits = _commits(store) & task1
    _scontrol(slurm, "requeue", f"{extract_job}_1")
    requeued_at = time.monotonic()
    _wait("task 1 back in the queue", lambda: _queued(slurm, f"{extract_job}_1") == ["PD"])
    hold.unlink()
    _wait("task 1's second attempt", lambda: _start_now(slurm, f"{extract_job}_1", requeued_at), explain=lambda: _scontrol(
        slurm, "show", "job", f"{extract_job}_1") + "\n" + _tail(Path(slurm["SLURM_CONF"]).parent / "log" / "slurmctld.log"))

    build_draft_vocab(one, int(VOCAB_SIZE))
    alone = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                              "-m", "peagle", "train", "--store", str(one), "--target", str(tiny_llama),
                              "--out", str(work / "run-alone"), "--draft-vocab-size", VOCAB_SIZE, *TRAIN],
                             env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait("the Slurm jobs", lambda: not _queued(slurm, extract_job) and not _queued(slurm, train_job),
          explain=lambda: _scontrol(slurm, "show", "job") + "\n" + "\n".join(
              f"== {log.name}\n{_tail(log)}" for log in sorted((work / "logs").glob("*.out"))))
    out, _ = alone.communicate(timeout=300)
    assert alone.returncode == 0, out
    return {"work": work, "store": store, "one": one, "extract_job": extract_job, "train_job": train_job,
            "held_commits": held_commits, "train_pending": train_pending,
            "extract_states": _scontrol(slurm, "show", "job", extract_job),
            "train_states": _scontrol(slurm, "show", "job", train_job)}


def _extract_here(data: Path, target: Path, out: Path) -> None:
    """``peagle extract`` with EXTRACT's settings, in this process (its imports are paid already)."""
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract

    num_threads = torch.get_num_threads()
    try:
        run_extract(ExtractConfig(data=(str(data),), target=str(target), out=str(out), backend="hf", device="cpu",
                                  samples_per_shard=2, topk=8, batch_size=2, threads=1),
                    echo=lambda _: None, progress=False)
    finally:
        torch.set_num_threads(num_threads)  # threads=1 set this process's


def _log(runs, name: str) -> str:
    return (runs["work"] / "logs" / name).read_text()


@pytest.mark.slow
@pytest.mark.slurm
def test_extract_array_with_a_requeued_task_leaves_the_one_process_store(runs):
    states = re.findall(r"JobState=(\S+)", runs["extract_states"])
    assert states == ["COMPLETED"] * NUM_TASKS, runs["extract_states"]
    assert 0 < len(runs["held_commits"]) < NUM_SHARDS // NUM_TASKS  # requeued mid-run: some of its 4 committed
    log = _log(runs, f"peagle-extract-{runs['extract_job']}_1.out")  # both attempts, one file (--open-mode=append)
    assert "DUE TO JOB REQUEUE" in log and "attempt 1," in log and "attempt 2," in log, log
    done = re.search(r"worker     1 of 3: 4 shards, (\d) already committed, (\d) to do", log.split("attempt 2,")[1])
    assert done and int(done.group(1)) >= len(runs["held_commits"]) and int(done.group(2)) > 0, log
    assert _commits(runs["store"]) == set(range(NUM_SHARDS))
    assert _snapshot(runs["store"] / "shards") == _snapshot(runs["one"] / "shards")
    store = {k: v for k, v in _snapshot(runs["store"]).items() if not k.startswith("vocab/")}  # train.sbatch's
    assert store == {k: v for k, v in _snapshot(runs["one"]).items() if not k.startswith("vocab/")}


@pytest.mark.slow
@pytest.mark.slurm
def test_train_recipe_after_the_extract_job_ends_with_the_weights_of_torchrun_alone(runs):
    assert f"Dependency=afterok:{runs['extract_job']}" in runs["train_pending"], runs["train_pending"]
    assert re.findall(r"JobState=(\S+)", runs["train_states"]) == ["COMPLETED"], runs["train_states"]
    log = _log(runs, f"peagle-train-{runs['train_job']}.out")
    assert "2 agents x 1 ranks" in log and "world 2 on cpu" in log, log
    assert (runs["store"] / "vocab" / f"draft-{VOCAB_SIZE}.json").read_bytes() == \
        (runs["one"] / "vocab" / f"draft-{VOCAB_SIZE}.json").read_bytes()  # built by the job, once extracted
    final = "checkpoints/step-00000003/model.pt"
    a, b = torch.load(runs["work"] / "run" / final), torch.load(runs["work"] / "run-alone" / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
