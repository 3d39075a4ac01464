"""A full disk during `peagle extract` or `peagle train`: one clear line and a non-zero exit, nothing
half-written visible, and the same command completes, with the uninterrupted result, once space is
freed (docs/reliability.md; issue 6).

Two ways to fill the disk: a file-size limit (RLIMIT_FSIZE: a write past it fails with EFBIG, as a
full disk fails with ENOSPC; works everywhere) and a small tmpfs (ENOSPC for real; needs the right
to mount, the tests skip with the reason otherwise). "Freed" = the limit lifted / the tmpfs
remounted bigger.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from faultkit import TRAIN_STEPS, compare_run, diff_snapshots, ok, one_line_error, snapshot, temp_files
from peagle.stages.store.info import verify_store
from peagle.stages.train.checkpoint import checkpoint_problem, list_checkpoints

AREA = "disk full"
NO_SPACE = "no space left"


class Tmpfs:
    """Small tmpfs mounts under one directory, unmounted at the end."""

    def __init__(self, root: Path):
        self.root, self.mounted = root, []

    def __call__(self, size: int) -> Path:
        """A fresh tmpfs of ``size`` bytes (skips the test when mounting is not allowed here)."""
        point = self.root / f"tmpfs{len(self.mounted)}"
        point.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({(res.stderr or res.stdout).strip() or res.returncode}); "
                        "the RLIMIT_FSIZE variants cover disk-full")
        self.mounted.append(point)
        return point

    def resize(self, point: Path, size: int) -> None:
        """Free space: the same mount, bigger."""
        subprocess.run(["mount", "-o", f"remount,size={size}", str(point)], check=True)

    def unmount_all(self) -> None:
        for point in self.mounted:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    mounts = Tmpfs(tmp_path)
    yield mounts
    mounts.unmount_all()


def check_store_after_failure(store: Path) -> list[str]:
    """Nothing half-written is visible: no temp files, every committed shard whole, manifest <= commits."""
    problems = [f"left behind: {t}" for t in temp_files(store)]
    if (store / "store.json").exists():
        _, bad = verify_store(store)
        problems += [p for p in bad if not p.startswith("incomplete: ")]  # a failed extraction is incomplete
        committed = {p.stem for p in (store / "commits").glob("[0-9]*.json")}
        if (store / "manifest.json").exists():
            listed = {Path(s["parquet"]).stem for s in json.loads((store / "manifest.json").read_text())["shards"]}
            problems += [f"manifest lists uncommitted shard {x}" for x in sorted(listed - committed)]
    return problems


def limit_between_shards(base) -> int:
    """A file-size limit that the first shards fit under and a later one does not."""
    sizes = [s["safetensors_bytes"] for s in sorted(base.manifest["shards"], key=lambda s: s["index"])]
    k = next(i for i in range(1, len(sizes)) if sizes[i] > max(sizes[:i]))
    return max(sizes[:k])


@pytest.mark.parametrize("limit", ["parquet", "mid-shards"])
def test_extract_file_size_limit(extract_baseline, runner, tmp_path, figures, limit):
    """RLIMIT_FSIZE below a Parquet file (the first shard fails) or between shard sizes (some commit).

    The error line tells the user what to do (re-run the same command), and no shard file is left
    in place without its commit record."""
    fsize = 1500 if limit == "parquet" else limit_between_shards(extract_baseline)
    store = tmp_path / "store"
    res = runner.run(*extract_baseline.args(store), fsize=fsize)
    figures.add(trials=1, faults_injected=1)
    one_line_error(res, f"{NO_SPACE} writing", "re-run the same command")
    assert check_store_after_failure(store) == []
    committed = {p.stem for p in (store / "commits").glob("[0-9]*.json")}
    shard_files = sorted((store / "shards").iterdir()) if (store / "shards").is_dir() else []
    assert [p.name for p in shard_files if p.stem not in committed] == []
    assert len(committed) < extract_baseline.manifest["num_shards"], "every shard fitted: the limit tests nothing"
    if limit == "mid-shards":
        assert committed, "no shard fitted: the limit tests nothing in between"
    ok(runner.run(*extract_baseline.args(store)))  # the limit lifted
    diffs = diff_snapshots(extract_baseline.files, snapshot(store))
    assert diffs == [], diffs
    figures.add(faults_survived=1)


def test_extract_tmpfs_refused_before_start(extract_baseline, runner, figures, tmpfs):
    """A disk too small for the plan: refused before any work, nothing written (docs/store.md)."""
    mount = tmpfs(256 * 1024)
    res = runner.run(*extract_baseline.args(mount / "store"))
    figures.add(trials=1, faults_injected=1)
    one_line_error(res, "not enough disk")
    assert not (mount / "store").exists()
    figures.add(faults_survived=1)


def test_extract_tmpfs_fills_up_mid_run(extract_baseline, runner, figures, tmpfs):
    """The plan fits (estimate = raw tensor bytes) but the files' overhead does not: ENOSPC mid-run."""
    m = extract_baseline.manifest
    estimate = m["num_tokens"] * (len(m["aux_layer_ids"]) * m["target"]["hidden_size"] * 2
                                  + m["topk"] * (4 + (2 if m["logprob_dtype"] == "float16" else 4)))
    mount = tmpfs(estimate + 16 * 1024)
    store = mount / "store"
    res = runner.run(*extract_baseline.args(store))
    figures.add(trials=1, faults_injected=1)
    one_line_error(res, NO_SPACE)
    assert check_store_after_failure(store) == []
    tmpfs.resize(mount, 64 << 20)  # space freed
    ok(runner.run(*extract_baseline.args(store)))
    diffs = diff_snapshots(extract_baseline.files, snapshot(store))
    assert diffs == [], diffs
    figures.add(faults_survived=1)


def check_run_after_failure(run: Path) -> list[str]:
    root = run / "checkpoints"
    problems = [f"{p.name}: {problem}" for p in list_checkpoints(run) if (problem := checkpoint_problem(p))]
    if root.is_dir():
        problems += [f"left behind: {p.name}" for p in root.iterdir() if p.name.startswith(".")]
    return problems


def test_train_file_size_limit(train_baseline, runner, tmp_path, figures):
    """RLIMIT_FSIZE below one checkpoint file: the first save fails cleanly; without it, the same result."""
    run = tmp_path / "run"
    res = runner.run(*train_baseline.args(run), fsize=1 << 20)
    figures.add(trials=1, faults_injected=1)
    one_line_error(res, NO_SPACE)
    assert check_run_after_failure(run) == []
    ok(runner.run(*train_baseline.args(run)))
    problems, lost = compare_run(train_baseline, run)
    figures.add(data_lost=lost)
    assert problems == []
    figures.add(faults_survived=1)


def test_train_tmpfs_fills_up_at_a_checkpoint(train_baseline, runner, figures, tmpfs):
    """Room for one checkpoint: the second save runs out of space; the first stays usable; after the
    remount the run resumes from it and ends like the uninterrupted run."""
    one = sum(f.stat().st_size for f in train_baseline.final.iterdir())
    mount = tmpfs(int(one * 1.6))
    run = mount / "run"
    res = runner.run(*train_baseline.args(run))
    figures.add(trials=1, faults_injected=1)
    one_line_error(res, NO_SPACE)
    assert check_run_after_failure(run) == []
    assert [p.name for p in list_checkpoints(run)] == ["step-00000002"]
    tmpfs.resize(mount, 64 << 20)
    res = ok(runner.run(*train_baseline.args(run)))
    assert "resumed from" in res.stderr and "step-00000002" in res.stderr, res.describe()
    problems, lost = compare_run(train_baseline, run)
    figures.add(data_lost=lost)
    assert problems == [] and lost == 0 and TRAIN_STEPS == max(json.loads(x)["step"] for x in
                                                               (run / "metrics.jsonl").read_text().splitlines())
    figures.add(faults_survived=1)
