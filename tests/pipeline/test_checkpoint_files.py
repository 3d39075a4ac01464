"""Reading checkpoints: listing, checking only the parts a reader needs, picking the newest whole one."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch

from peagle.pipeline.checkpoint_files import (checkpoint_problem, checkpoint_step, latest_valid_checkpoint,
                                              list_checkpoints, read_checkpoint_part)
from peagle.schemas.checkpoint import (ALL_PARTS, CHECKPOINTS_DIR, CONFIG, FORMAT_VERSION, METADATA_FILE, MODEL,
                                       OPTIMIZER, part_file, step_dir_name)


def write_checkpoint(run_dir: Path, step: int, *, format_version: int = FORMAT_VERSION) -> Path:
    """A checkpoint written from the format alone (no trainer): one small tensor dict per part."""
    path = run_dir / CHECKPOINTS_DIR / step_dir_name(step)
    path.mkdir(parents=True)
    files = {}
    for key in ALL_PARTS:
        buffer = io.BytesIO()
        torch.save({"key": key, "step": torch.tensor(step)}, buffer)
        data = buffer.getvalue()
        (path / part_file(key)).write_bytes(data)
        files[part_file(key)] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta = {"format_version": format_version, "step": step, "parts": sorted(ALL_PARTS), "files": files}
    (path / METADATA_FILE).write_text(json.dumps(meta))
    return path


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_listing_is_by_step_and_ignores_temp_and_other_names(tmp_path):
    for step in (10, 2, 100):
        write_checkpoint(tmp_path, step)
    (tmp_path / CHECKPOINTS_DIR / ".step-00000200.tmp-1-x").mkdir()
    (tmp_path / CHECKPOINTS_DIR / "step-notanumber").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == [step_dir_name(s) for s in (2, 10, 100)]
    assert list_checkpoints(tmp_path / "nowhere") == []
    assert checkpoint_step(list_checkpoints(tmp_path)[-1]) == 100


def test_a_reader_checks_only_the_parts_it_reads(tmp_path, capsys):
    old, new = write_checkpoint(tmp_path, 1), write_checkpoint(tmp_path, 2)
    flip_a_byte(new / part_file(OPTIMIZER))
    assert checkpoint_problem(new) == f"{part_file(OPTIMIZER)} sha256 does not match its metadata"
    assert checkpoint_problem(new, (MODEL, CONFIG)) is None
    assert latest_valid_checkpoint(tmp_path) == old  # resume needs every part
    assert "step-00000002 is damaged" in capsys.readouterr().err
    assert latest_valid_checkpoint(tmp_path, (MODEL, CONFIG)) == new  # export needs model and config
    assert read_checkpoint_part(new, MODEL) == {"key": MODEL, "step": torch.tensor(2)}


def test_problems_are_named(tmp_path):
    path = write_checkpoint(tmp_path, 1)
    (path / part_file(MODEL)).write_bytes((path / part_file(MODEL)).read_bytes()[:-3])
    assert "model.pt has" in checkpoint_problem(path) and "metadata says" in checkpoint_problem(path)
    (path / part_file(MODEL)).unlink()
    assert checkpoint_problem(path) == "model.pt is missing"
    assert "format_version 2" in checkpoint_problem(write_checkpoint(tmp_path, 2, format_version=2))
    path = write_checkpoint(tmp_path, 3)
    meta = json.loads((path / METADATA_FILE).read_text())
    del meta["files"][part_file(CONFIG)]
    (path / METADATA_FILE).write_text(json.dumps(meta))
    assert checkpoint_problem(path) == "parts ['config'] are missing"
    (path / METADATA_FILE).write_text("{")
    assert checkpoint_problem(path) == f"{METADATA_FILE} unreadable (JSONDecodeError)"
