"""Fixtures of the fault-injection suite (docs/reliability.md, issue 6).

* ``runner``: starts real ``peagle`` processes (warm fork server by default; ``PEAGLE_FAULTS_COLD=1``:
  fresh interpreters), to run, kill and re-run.
* ``figures``: each test's reliability figures; at the end of the session they are written, with
  their totals, to ``PEAGLE_RELIABILITY_OUT`` (default: ``reliability.json`` in pytest's base temp
  directory), which ``scripts/reliability_report.py`` turns into the README table.
* ``extract_baseline`` / ``train_baseline``: the uninterrupted runs every fault trial is compared with.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

# The suite's helpers live beside this file; pytest runs with --import-mode=importlib, which puts no
# test directory on sys.path, so this conftest (imported before the test modules) does.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from faultkit import (  # noqa: E402
    BAD_LINES, EXTRACT_FLAGS, NUM_RECORDS, TRAIN_FLAGS, TRAIN_STEPS, Figures, ok, snapshot, train_steps)
from peagle.testing.chat_data import write_chat_jsonl
from peagle.testing.warm_cli import Runner

_collected: list[dict] = []  # one entry per test that used ``figures``
_summary_path: list[Path] = []
_phase_seconds: list[float] = []


def pytest_runtest_logreport(report):
    """Add up the time of this folder's tests (setup, call, teardown; a conftest's item hooks see
    only its own folder's items): the suite's own wall time, also inside a whole-repo run."""
    _phase_seconds.append(report.duration)


def pytest_runtest_makereport(item, call):
    """Remember each phase's outcome on the item, so ``figures`` can say whether its test passed."""
    if call.when == "call":
        item.fault_outcome = "passed" if call.excinfo is None else (
            "skipped" if call.excinfo.errisinstance(pytest.skip.Exception) else "failed")


def pytest_terminal_summary(terminalreporter):
    if _summary_path:
        terminalreporter.write_line(f"reliability summary: {_summary_path[0]}")


@pytest.fixture(scope="session")
def reliability_out(tmp_path_factory) -> Path:
    env = os.environ.get("PEAGLE_RELIABILITY_OUT")
    return Path(env) if env else tmp_path_factory.getbasetemp() / "reliability.json"


@pytest.fixture(scope="session")
def _reliability_session(reliability_out):
    """Writes the aggregate once every fault test has run (also when some failed)."""
    yield
    totals = {key: sum(t[key] for t in _collected if t["outcome"] != "skipped")
              for key in ("trials", "faults_injected", "faults_survived", "bad_inputs_tried", "bad_inputs_handled",
                          "data_lost")}
    import torch

    from peagle.testing.bad_records import bad_records

    summary = {
        "suite": "tests/faults",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cold": os.environ.get("PEAGLE_FAULTS_COLD") == "1",
        "wall_s": round(sum(_phase_seconds), 1),  # this folder's tests (the last teardown excepted)
        "tests_passed": sum(t["outcome"] == "passed" for t in _collected),
        "tests_failed": sum(t["outcome"] == "failed" for t in _collected),
        "tests_skipped": sum(t["outcome"] == "skipped" for t in _collected),
        "totals": totals,
        "bad_records_catalogue": len(bad_records()),
        "tests": _collected,
    }
    reliability_out.parent.mkdir(parents=True, exist_ok=True)
    reliability_out.write_text(json.dumps(summary, indent=1) + "\n")
    _summary_path[:] = [reliability_out]


@pytest.fixture
def figures(request, _reliability_session) -> Figures:
    """This test's figures; recorded with its outcome when it ends."""
    doc = (request.function.__doc__ or "").strip()
    claim = " ".join(doc.split("\n\n")[0].split())
    fig = Figures(area=getattr(request.module, "AREA", "other"), test=request.node.name, claim=claim)
    started = time.monotonic()
    yield fig
    entry = fig.to_dict()
    entry["outcome"] = getattr(request.node, "fault_outcome", "failed")
    entry["wall_s"] = round(time.monotonic() - started, 1)
    _collected.append(entry)


@pytest.fixture(scope="session")
def runner(cli_runner, tmp_path_factory) -> Iterator[Runner]:
    """The session's warm runner (tests/conftest.py), or with ``PEAGLE_FAULTS_COLD=1`` a cold one."""
    if os.environ.get("PEAGLE_FAULTS_COLD") != "1":
        yield cli_runner
        return
    r = Runner(tmp_path_factory.mktemp("fault-logs"), cold=True)
    yield r
    r.close()


# ---------------------------------------------------------------------------------------------------
# Baselines


@dataclass(frozen=True)
class ExtractBaseline:
    data: Path
    target: Path
    store: Path
    files: dict[str, str]  # snapshot: relative path -> sha256
    manifest: dict
    wall_s: float

    def args(self, out: Path, *extra: str) -> list[str]:
        return ["extract", "--data", str(self.data), "--target", str(self.target), "--out", str(out),
                *EXTRACT_FLAGS, *extra]

    def samples_per_shard(self) -> dict[str, int]:
        return {s["parquet"]: s["num_samples"] for s in self.manifest["shards"]} | {
            s["safetensors"]: s["num_samples"] for s in self.manifest["shards"]}


@pytest.fixture(scope="session")
def extract_baseline(tmp_path_factory, tiny_llama, runner) -> ExtractBaseline:
    """One uninterrupted extraction (the reference every killed-and-resumed store must equal)."""
    root = tmp_path_factory.mktemp("extract-baseline")
    data = write_chat_jsonl(root / "chat.jsonl", NUM_RECORDS, seed=7, bad_lines=BAD_LINES)
    store = root / "store"
    res = ok(runner.run("extract", "--data", data, "--target", tiny_llama, "--out", store, *EXTRACT_FLAGS))
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["num_shards"] == 8 and sum(manifest["skipped"].values()) == len(BAD_LINES)
    return ExtractBaseline(data=data, target=tiny_llama, store=store, files=snapshot(store), manifest=manifest,
                           wall_s=res.wall_s)


@dataclass(frozen=True)
class TrainBaseline:
    store: Path
    target: Path
    run: Path
    steps: dict[int, dict]  # step -> the metrics that must repeat exactly
    final: Path  # the last checkpoint directory
    wall_s: float

    def args(self, out: Path, *extra: str) -> list[str]:
        return ["train", "--store", str(self.store), "--target", str(self.target), "--out", str(out),
                *TRAIN_FLAGS, *extra]


@pytest.fixture(scope="session")
def train_baseline(tmp_path_factory, extract_baseline, runner) -> TrainBaseline:
    root = tmp_path_factory.mktemp("train-baseline")
    base = TrainBaseline(store=extract_baseline.store, target=extract_baseline.target, run=root / "run", steps={},
                         final=root / "run" / "checkpoints" / f"step-{TRAIN_STEPS:08d}", wall_s=0.0)
    res = ok(runner.run(*base.args(base.run)))
    steps = train_steps(base.run)
    assert sorted(steps) == list(range(1, TRAIN_STEPS + 1)), steps.keys()
    assert base.final.is_dir()
    return TrainBaseline(store=base.store, target=base.target, run=base.run, steps=steps, final=base.final,
                         wall_s=res.wall_s)
