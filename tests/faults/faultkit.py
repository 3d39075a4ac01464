"""Shared machinery of the fault suite: the trials' settings, running them side by side, and
comparing what a killed-and-resumed command left on disk with an uninterrupted one's.

Commands run through :mod:`peagle.testing.warm_cli` (``Runner``, ``Job``, ``Result``: the warm fork
server or a cold subprocess; both give the same processes to kill). ``PEAGLE_FAULTS_COLD=1`` runs the
whole suite cold (slower; a fidelity check).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from peagle.testing.warm_cli import Result

# Extraction settings of every extract trial: 8 shards of <= 4 records, 2 forward batches per shard.
NUM_RECORDS = 30
BAD_LINES = {5: '{"messages": "not a list"}', 17: "{truncated"}
EXTRACT_FLAGS = ("--samples-per-shard", "4", "--topk", "8", "--backend", "hf", "--device", "cpu",
                 "--batch-size", "2", "--max-seq-len", "256", "--threads", "1")

# Training settings of every train trial: 10 steps over ~1.3 epochs, a checkpoint every 2 steps.
TRAIN_STEPS = 10
SAVE_EVERY = 2
TRAIN_FLAGS = ("--num-layers", "1", "--num-depths", "3", "--max-steps", str(TRAIN_STEPS), "--token-budget", "640",
               "--num-workers", "0", "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "2", "--log-every", "1",
               "--eval-every", "0", "--heldout-fraction", "0", "--warmup-steps", "2", "--seed", "3")

KILLED = -signal.SIGKILL


def jobs() -> int:
    """How many trials run at once: one per core, at least 1 (``PEAGLE_FAULT_JOBS`` overrides)."""
    return max(1, int(os.environ.get("PEAGLE_FAULT_JOBS", "0")) or min(os.cpu_count() or 1, 4))


def parallel_map(fn: Callable, items: Iterable) -> list:
    """``[fn(x) for x in items]`` with ``jobs()`` threads (each trial is its own process anyway)."""
    items = list(items)
    with ThreadPoolExecutor(max_workers=jobs()) as pool:
        return list(pool.map(fn, items))


# ---------------------------------------------------------------------------------------------------
# Checks


def ok(result: Result) -> Result:
    assert result.returncode == 0, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    return result


def killed(result: Result) -> Result:
    assert result.returncode == KILLED, "expected a SIGKILL\n" + result.describe()
    return result


ERROR_PREFIX = "peagle: error: "


def one_line_error(result: Result, *needles: str, rc: int = 2) -> str:
    """The command failed with ``rc`` and ended with exactly one ``peagle: error:`` line, no traceback.

    A progress bar may precede the error on the same terminal line (tqdm leaves its line open);
    the error is what follows the prefix up to the end of stderr.
    """
    assert result.returncode == rc, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert result.stderr.count(ERROR_PREFIX) == 1, result.describe()
    error = ERROR_PREFIX + result.stderr.split(ERROR_PREFIX, 1)[1].rstrip("\n")
    assert "\n" not in error, result.describe()
    for needle in needles:
        assert needle in error, f"{needle!r} not in {error!r}"
    return error


def snapshot(root: Path, *, skip: Iterable[str] = (".lock",)) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> digest); the lock file excluded."""
    skip = set(skip)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def diff_snapshots(want: dict[str, str], got: dict[str, str]) -> list[str]:
    out = [f"missing {k}" for k in sorted(set(want) - set(got))]
    out += [f"extra {k}" for k in sorted(set(got) - set(want))]
    out += [f"differs {k}" for k in sorted(set(want) & set(got)) if want[k] != got[k]]
    return out


def temp_files(root: Path) -> list[str]:
    """Leftovers of killed writers (``.name.tmp-pid-rand``) anywhere under ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp-" in p.name)


@dataclass
class Figures:
    """What one test contributes to the reliability summary."""

    area: str
    test: str = ""
    claim: str = ""  # what the test shows (its docstring's first line)
    trials: int = 0
    faults_injected: int = 0
    faults_survived: int = 0
    bad_inputs_tried: int = 0
    bad_inputs_handled: int = 0  # skipped and counted under the expected reason
    data_lost: int = 0
    notes: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                setattr(self, key, getattr(self, key) + value)

    def to_dict(self) -> dict:
        return {"area": self.area, "test": self.test, "claim": self.claim, "trials": self.trials,
                "faults_injected": self.faults_injected, "faults_survived": self.faults_survived,
                "bad_inputs_tried": self.bad_inputs_tried, "bad_inputs_handled": self.bad_inputs_handled,
                "data_lost": self.data_lost, "notes": self.notes}


# ---------------------------------------------------------------------------------------------------
# Training runs

REPEATABLE_METRICS = ("loss", "depth_loss", "depth_agreement", "depth_count", "lr", "grad_norm", "tokens_seen",
                      "num_no_target", "acceptance_length_estimate", "num_chains", "epoch")


def train_steps(run: Path) -> dict[int, dict]:
    """step -> the deterministic part of its metrics line (timings left out)."""
    steps = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            assert record["step"] not in steps, f"step {record['step']} logged twice in {run}"
            steps[record["step"]] = {k: record.get(k) for k in REPEATABLE_METRICS}
    return steps

# Every checkpoint part that decides what training does next. The global RNG states are checked on
# their own (test_resume_restores_the_global_torch_rng): Python's and numpy's are never seeded by the
# trainer, so they differ between any two fresh processes.
COMPARED_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


def same_state(a, b, where: str = "") -> list[str]:
    """Where two loaded checkpoint parts differ (exact equality of every tensor and value)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)):
            return [where]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(set(a) ^ set(b), key=str)}"]
        return [d for k in a for d in same_state(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_state(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def compare_run(base, run: Path) -> tuple[list[str], int]:
    """(problems, steps whose metrics differ or are missing) of a finished run vs the baseline
    (``base``: conftest's TrainBaseline): metrics of every step, the final checkpoint's parts, and
    no leftover temp directories."""
    import torch

    problems = []
    steps = train_steps(run)
    lost = [s for s, m in base.steps.items() if steps.get(s) != m]
    if lost:
        first = lost[0]
        problems.append(f"steps {lost} differ from the uninterrupted run; step {first}: "
                        f"{steps.get(first)} vs {base.steps[first]}")
    if sorted(steps) != sorted(base.steps):
        problems.append(f"logged steps {sorted(steps)}")
    final = run / "checkpoints" / base.final.name
    if not final.is_dir():
        return problems + [f"no final checkpoint {final.name}"], len(lost)
    for part in COMPARED_PARTS:
        got = torch.load(final / f"{part}.pt", weights_only=True)
        want = torch.load(base.final / f"{part}.pt", weights_only=True)
        diffs = same_state(want, got, part)
        if diffs:
            problems.append(f"final {part} differs at {diffs[:3]}")
    leftovers = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("."))
    if leftovers:
        problems.append(f"leftovers in checkpoints/: {leftovers}")
    return problems, len(lost)
