"""`peagle export`: a training checkpoint -> a speculators 'peagle' directory vLLM serves (DESIGN §6).

Reads the checkpoint through its format (peagle/schemas/checkpoint.py, read by
peagle/pipeline/checkpoint_files.py; stages never import each other): the model part is the
unwrapped draft's state dict, the config part holds the run's TrainConfig and DraftConfig; the sizes
and sha256 of both are checked against ``metadata.json`` before anything is read. The export directory
itself is written by the format's one home, :mod:`peagle.model.speculators_format` (atomically:
a reader such as vLLM sees a whole export or none; re-exporting replaces an export whole).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import peagle
from peagle.model import speculators_format as fmt
from peagle.model.target import CONFIG_FILE, read_config_json
from peagle.pipeline.checkpoint_files import (checkpoint_problem, checkpoint_step, latest_valid_checkpoint,
                                              list_checkpoints, read_checkpoint_part)
from peagle.schemas.checkpoint import (CHECKPOINTS_DIR, CONFIG, DRAFT_CONFIG_KEY, METADATA_FILE, MODEL,
                                       TRAIN_CONFIG_KEY, part_file)
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError

EXPORTED_PARTS = (MODEL, CONFIG)
"""The checkpoint parts export reads, and so checks (not the optimizer state: a third of the bytes)."""
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Settings of `peagle export`."""

    source: str
    """A training run directory (its newest valid checkpoint is exported) or one checkpoint
    directory (RUN_DIR/checkpoints/step-N)."""
    out: str
    """Export directory to create (replaced whole if it already holds an export)."""
    verifier_name: str | None = None
    """Verifier recorded in the export and loaded by `LLM(model=OUT)`. Default: the target path
    given to training. A hub-style name (org/model) makes the export portable."""
    speculative_tokens: int | None = None
    """K: draft tokens vLLM proposes per step. Default: the trained number of depths."""
    dtype: str = "float32"
    """Weight dtype in model.safetensors: float32 (lossless) or bfloat16 (half the size)."""

    def __post_init__(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise UserError(f"--dtype must be one of {'|'.join(EXPORT_DTYPES)}, got {self.dtype!r}")
        if self.speculative_tokens is not None and self.speculative_tokens < 1:
            raise UserError(f"--speculative-tokens must be >= 1, got {self.speculative_tokens}")


@dataclass(kw_only=True)
class DraftCheckpoint:
    """What export (and eval) need from one training checkpoint."""

    path: Path
    step: int
    state_dict: dict[str, torch.Tensor]
    draft_config: DraftConfig
    train_config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # everything else config.pt records


def resolve_checkpoint(source: str | os.PathLike) -> Path:
    """The checkpoint directory ``source`` names: itself, or the newest valid one of a run directory.

    Raises:
        UserError: when nothing usable is there.
    """
    source = Path(source)
    if not source.exists():
        raise UserError(f"{source} does not exist")
    if (source / METADATA_FILE).is_file():
        problem = checkpoint_problem(source, EXPORTED_PARTS)
        if problem:
            raise UserError(f"checkpoint {source} is damaged: {problem}")
        return source
    if not list_checkpoints(source):
        raise UserError(f"{source} is neither a checkpoint nor a run directory with {CHECKPOINTS_DIR}/step-N")
    path = latest_valid_checkpoint(source, EXPORTED_PARTS)
    if path is None:
        raise UserError(f"no valid checkpoint in {source / CHECKPOINTS_DIR}")
    return path


def read_checkpoint(source: str | os.PathLike) -> DraftCheckpoint:
    """Load the draft state dict and configs of a run's newest valid checkpoint (or of one checkpoint)."""
    path = resolve_checkpoint(source)
    state_dict = read_checkpoint_part(path, MODEL)
    draft_dict, train_dict, extra = split_config_part(read_checkpoint_part(path, CONFIG), path)
    return DraftCheckpoint(path=path, step=checkpoint_step(path), state_dict=state_dict,
                           draft_config=DraftConfig.from_dict(draft_dict), train_config=train_dict, extra=extra)


def split_config_part(saved: Any, path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(draft config dict, train config dict, the rest) from a checkpoint's config part."""
    if not isinstance(saved, dict):
        raise UserError(f"{path / part_file(CONFIG)} is not a mapping; was it written by another peagle version?")
    rest = dict(saved)
    if DRAFT_CONFIG_KEY not in rest:
        raise UserError(f"{path / part_file(CONFIG)} records no draft config (keys: {sorted(saved)})")
    draft, train = rest.pop(DRAFT_CONFIG_KEY), rest.pop(TRAIN_CONFIG_KEY, None)
    return dict(draft), dict(train or {}), rest


def run_export(config: ExportConfig) -> Path:
    """Export the checkpoint ``config.source`` to ``config.out``; returns the export directory."""
    ckpt = read_checkpoint(config.source)
    target = ckpt.train_config.get("target")
    verifier_name = config.verifier_name or (str(Path(target).resolve()) if target else None)
    if not verifier_name:
        raise UserError("the checkpoint records no target path: pass --verifier-name")
    trained_depths = ckpt.train_config.get("num_depths")
    k = config.speculative_tokens or trained_depths
    if k is None:
        raise UserError("the checkpoint records no num_depths: pass --speculative-tokens")
    if trained_depths is not None and k > trained_depths:
        print(f"peagle: warning: --speculative-tokens {k} exceeds the {trained_depths} trained depths; "
              "deeper drafts are untrained and will rarely be accepted", file=sys.stderr)
    provenance = {
        "peagle_version": peagle.__version__,
        "git_revision": ckpt.extra.get("git_revision") or git_revision(),
        "checkpoint": str(ckpt.path.resolve()),
        "step": ckpt.step,
        "store_manifest_hash": ckpt.extra.get("store_manifest_hash") or ckpt.extra.get("manifest_hash"),
        "num_depths_trained": trained_depths,
        "draft_config": ckpt.draft_config.to_dict(),
        "run_config": ckpt.train_config,
    }
    return fmt.write_export(ckpt.state_dict, ckpt.draft_config, config.out, verifier_name=verifier_name,
                            verifier_architectures=verifier_architectures(target, verifier_name),
                            speculative_tokens=int(k), dtype=EXPORT_DTYPES[config.dtype], provenance=provenance)


def verifier_architectures(target: str | None, verifier_name: str) -> list[str]:
    """The verifier's ``architectures`` from a local target directory (the training target, else the name)."""
    for candidate in (target, verifier_name):
        if candidate and (Path(candidate) / CONFIG_FILE).is_file():
            with contextlib.suppress(UserError):
                return list(read_config_json(candidate).get("architectures") or [])
    return []


def git_revision() -> str | None:
    """The git commit of the peagle source tree, if it is a checkout (provenance only)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(peagle.__file__).parent, capture_output=True,
                              text=True, timeout=10)
        if done.returncode == 0:
            return done.stdout.strip()
    return None
