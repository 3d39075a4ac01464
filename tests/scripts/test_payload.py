"""scripts/payload.py: a large file crosses to a machine in parts (a wheel to the GPU box, an export
back) and arrives identical, or the join refuses in one line and writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "payload.py"
SIZE = 2 * 2**20 + 12345
"""Three parts at --part-mib 1, the last one short."""


def payload(*args: object) -> subprocess.CompletedProcess:
    """The script as the GPU machine runs it: `-I -S`, so no site-packages (stdlib only) and no
    PYTHONPATH (nothing of peagle's)."""
    return subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def one_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("payload: error: "), done.stderr
    return lines[0]


@pytest.fixture
def sent(tmp_path) -> tuple[bytes, Path]:
    """Random bytes split into parts; returns (the bytes, the folder of parts and manifest)."""
    data = os.urandom(SIZE)
    (tmp_path / "model.whl").write_bytes(data)
    done = payload("split", tmp_path / "model.whl", "--out", tmp_path / "parts", "--part-mib", 1)
    assert done.returncode == 0, done.stderr
    return data, tmp_path / "parts"


def stage_all(parts: Path, stage: Path) -> None:
    """Each part on its own, as one command per part delivers them; the manifest travels with each."""
    for part in sorted(parts.glob("model.whl.part-*")):
        lone = stage.parent / "inbox" / part.name
        lone.parent.mkdir(exist_ok=True)
        lone.write_bytes(part.read_bytes())
        done = payload("add", lone, "--into", stage, "--manifest", parts / "model.whl.sha256.json")
        assert done.returncode == 0, done.stderr
        lone.unlink()


def test_split_add_join_gives_the_same_bytes(sent, tmp_path):
    data, parts = sent
    manifest = json.loads((parts / "model.whl.sha256.json").read_text())
    assert [p["file"] for p in manifest["parts"]] == [f"model.whl.part-00{i}" for i in range(3)]
    assert [p["size"] for p in manifest["parts"]] == [2**20, 2**20, 12345]
    assert (manifest["name"], manifest["size"]) == ("model.whl", SIZE)
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    stage = tmp_path / "stage"
    stage_all(parts, stage)
    again = payload("add", parts / "model.whl.part-001", "--into", stage)  # idempotent; manifest found beside it
    assert again.returncode == 0 and "already there" in again.stdout and "3 of 3 parts" in again.stdout
    status = payload("status", stage)
    assert status.returncode == 0 and status.stdout.splitlines() == [
        f"model.whl: 3 of 3 parts present, complete, ready to join ({SIZE:,} bytes, sha256 {manifest['sha256']})"]
    out = tmp_path / "got" / "model.whl"
    done = payload("join", "model.whl", "--from", stage, "--out", out, "--expect-sha256", manifest["sha256"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{out}: {SIZE:,} bytes, sha256 {manifest['sha256']}"]
    assert out.read_bytes() == data


def test_a_missing_part_is_named_and_nothing_is_written(sent, tmp_path):
    _, parts = sent
    stage = tmp_path / "stage"
    stage_all(parts, stage)
    (stage / "model.whl.part-001").unlink()
    assert "missing part(s) 001" in payload("status", stage).stdout
    line = one_error(payload("join", "model.whl", "--from", stage, "--out", tmp_path / "out.whl"))
    assert "missing model.whl.part-001 (of 3 parts)" in line
    assert not (tmp_path / "out.whl").exists()


def test_a_corrupted_part_is_refused_by_add_and_by_join(sent, tmp_path):
    _, parts = sent
    stage = tmp_path / "stage"
    stage_all(parts, stage)
    for folder in (parts, stage):  # same size, one byte flipped
        with open(folder / "model.whl.part-002", "r+b") as f:
            f.seek(7)
            byte = f.read(1)
            f.seek(7)
            f.write(bytes([byte[0] ^ 0xFF]))
    line = one_error(payload("add", parts / "model.whl.part-002", "--into", tmp_path / "other"))
    assert "model.whl.part-002 has sha256" in line and "the manifest says" in line
    assert list((tmp_path / "other").iterdir()) == []  # neither the part nor a temp file of it
    line = one_error(payload("join", "model.whl", "--from", stage, "--out", tmp_path / "out.whl"))
    assert "bad (size or sha256 differs from the manifest) model.whl.part-002" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inbox", "model.whl", "other", "parts", "stage"]


def test_an_unexpected_sha256_is_refused(sent, tmp_path):
    _, parts = sent
    stage = tmp_path / "stage"
    stage_all(parts, stage)
    line = one_error(payload("join", "model.whl", "--from", stage, "--out", tmp_path / "out.whl",
                             "--expect-sha256", "0" * 64))
    assert f"--expect-sha256 says {'0' * 64}" in line
    assert not (tmp_path / "out.whl").exists()


def test_usage_mistakes_are_one_line(sent, tmp_path):
    _, parts = sent
    one_error(payload("split", tmp_path / "model.whl"))  # no --out
    one_error(payload("split", tmp_path / "absent", "--out", tmp_path / "p"))
    one_error(payload("add", tmp_path / "model.whl", "--into", tmp_path / "stage"))  # not a part's name
    one_error(payload("join", "model.whl", "--from", tmp_path / "empty", "--out", tmp_path / "o"))  # no manifest
    one_error(payload("status", tmp_path / "absent"))
