"""Finding and trusting training checkpoints: the reading side of the format (schemas/checkpoint.py).

`peagle train` (resume), `peagle export` and `peagle eval` (on a run) read checkpoints; stages never
import each other, so what they share lives here: listing ``step-N`` directories, checking every
file's size and sha256 against ``metadata.json``, picking the newest whole checkpoint, loading one
part, and reading the draft of one (:func:`read_draft_checkpoint`).
A checkpoint is damaged when a disk lost data or a copy was cut short; the newest one that checks
out is used, with a one-line warning per damaged one skipped.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle.pipeline.contained import inside
from peagle.pipeline.store import sha256_file
from peagle.schemas.checkpoint import (ALL_PARTS, CHECKPOINTS_DIR, CONFIG, DRAFT_CONFIG_KEY, FORMAT_VERSION,
                                       METADATA_FILE, MODEL, PROVENANCE_KEY, STEP_DIR, TRAIN_CONFIG_KEY, part_file)
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError, not_weights_only_line

DRAFT_PARTS = (MODEL, CONFIG)
"""The parts that hold a trained draft, and so the ones export checks (not the optimizer state: a
third of the bytes)."""


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Committed checkpoint directories, oldest first (validity is not checked here).

    Every reader of a run's checkpoints, and the pruning that deletes old ones, lists them here, so a
    run from elsewhere whose ``checkpoints/`` or ``step-N`` is a link out of it is refused here, before
    anything there is read or deleted (:mod:`peagle.pipeline.contained`).

    Raises:
        UserError: one line naming the run and the directory that leads outside it.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    inside(run_dir, CHECKPOINTS_DIR, tree="run")
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [inside(run_dir, f"{CHECKPOINTS_DIR}/{p.name}", tree="run") for _, p in sorted(found)]


def checkpoint_problem(path: Path, parts: tuple[str, ...] = ALL_PARTS) -> str | None:
    """Why ``parts`` of the checkpoint ``path`` cannot be trusted (metadata, missing file, size, sha256), or None.

    A reader that needs only some parts (export: model and config) checks only those: it does not
    hash the optimizer state, and a damaged part it never reads does not stop it.
    """
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
        files = meta["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        return f"{METADATA_FILE} unreadable ({type(err).__name__})"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format_version {meta.get('format_version')} (this peagle reads {FORMAT_VERSION})"
    missing = [key for key in parts if part_file(key) not in files]
    if missing:
        return f"parts {missing} are missing"
    for name in sorted(part_file(key) for key in parts):
        info, file = files[name], path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != info["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, metadata says {info['bytes']}"
        if sha256_file(file) != info["sha256"]:
            return f"{name} sha256 does not match its metadata"
    return None


def latest_valid_checkpoint(run_dir: str | os.PathLike, parts: tuple[str, ...] = ALL_PARTS) -> Path | None:
    """The newest checkpoint whose ``parts`` match their checksums; damaged newer ones are warned about."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path, parts)
        if problem is None:
            return path
        print(f"peagle: warning: checkpoint {path} is damaged ({problem}); trying the one before it",
              file=sys.stderr)
    return None


def checkpoint_step(path: Path) -> int:
    return int(json.loads((path / METADATA_FILE).read_text())["step"])


def read_checkpoint_part(path: str | os.PathLike, key: str, *, map_location: str | torch.device = "cpu") -> Any:
    """One part of a checkpoint (weights-only unpickling: plain containers and tensors).

    Raises:
        UserError: the part holds anything else (a pickle that would run code), naming the file.
    """
    file = Path(path) / part_file(key)
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UserError(not_weights_only_line(file, err)) from None


@dataclass(kw_only=True)
class DraftCheckpoint:
    """The draft of one training checkpoint: weights, configs, and what training recorded."""

    path: Path
    step: int
    state_dict: dict[str, torch.Tensor]
    draft_config: DraftConfig
    train_config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)  # peagle version, git revision, host
    extra: dict[str, Any] = field(default_factory=dict)  # everything else config.pt records (store hashes, ...)


def resolve_checkpoint(source: str | os.PathLike) -> Path:
    """The checkpoint directory ``source`` names: itself, or the newest valid one of a run directory.

    Raises:
        UserError: when nothing usable is there.
    """
    source = Path(source)
    if not source.exists():
        raise UserError(f"{source} does not exist")
    if (source / METADATA_FILE).is_file():
        problem = checkpoint_problem(source, DRAFT_PARTS)
        if problem:
            raise UserError(f"checkpoint {source} is damaged: {problem}")
        return source
    if not list_checkpoints(source):
        raise UserError(f"{source} is neither a checkpoint nor a run directory with {CHECKPOINTS_DIR}/step-N")
    path = latest_valid_checkpoint(source, DRAFT_PARTS)
    if path is None:
        raise UserError(f"no valid checkpoint in {source / CHECKPOINTS_DIR}")
    return path


def read_draft_checkpoint(source: str | os.PathLike) -> DraftCheckpoint:
    """The draft of a run's newest valid checkpoint (or of one checkpoint directory).

    Raises:
        UserError: nothing usable there, or a config part this peagle cannot read.
    """
    path = resolve_checkpoint(source)
    saved = read_checkpoint_part(path, CONFIG)
    if not isinstance(saved, dict):
        raise UserError(f"{path / part_file(CONFIG)} is not a mapping; was it written by another peagle version?")
    rest = dict(saved)
    if DRAFT_CONFIG_KEY not in rest:
        raise UserError(f"{path / part_file(CONFIG)} records no draft config (keys: {sorted(saved)})")
    draft, train = rest.pop(DRAFT_CONFIG_KEY), rest.pop(TRAIN_CONFIG_KEY, None)
    return DraftCheckpoint(path=path, step=checkpoint_step(path), state_dict=read_checkpoint_part(path, MODEL),
                           draft_config=DraftConfig.from_dict(dict(draft)), train_config=dict(train or {}),
                           provenance=dict(rest.pop(PROVENANCE_KEY, None) or {}), extra=rest)
