"""A training checkpoint's on-disk contract: directory names, part names, metadata fields.

The checkpoint directory is what `peagle train` hands to `peagle export` (and to its own resume)::

    RUN_DIR/checkpoints/
      step-00000040/                  a checkpoint exists exactly when this name exists
        model.pt                      the UNWRAPPED draft's state dict (no DDP/FSDP/compile prefixes)
        optimizer.pt  lr_scheduler.pt  train_state.pt  config.pt
        dataloader.pt  rng.pt         per-rank parts: {"world_size": W, "rank_0": ..., "rank_1": ...}
        metadata.json                 written last: format_version, step, parts, bytes and sha256 of every file,
                                      weights_finite (whether every model weight is finite)
      .step-00000080.tmp-<pid>-<rand>/  being written (ignored by every reader)

``config.pt`` is a dict: ``train_config`` (TrainConfig.to_dict()), ``draft_config``
(DraftConfig.to_dict()), ``provenance`` (peagle version, git revision, host of the training
process: peagle/pipeline/provenance.py), ``world_size`` and the stores trained on
(``store_manifest_hash``, ...).
Plain names only here; the writer is stages/train/checkpoint.py, the readers pipeline/checkpoint_files.py.
"""

from __future__ import annotations

import re

CHECKPOINTS_DIR = "checkpoints"
METADATA_FILE = "metadata.json"
FORMAT_VERSION = 1

# The Stateful parts, under constant keys (torchtitan's checkpoint layout).
MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
RNG = "rng"
CONFIG = "config"

SHARED_PARTS = (MODEL, OPTIMIZER, LR_SCHEDULER, TRAIN_STATE, CONFIG)
"""Equal on every rank (or already gathered to full tensors): rank 0's copy is written."""
PER_RANK_PARTS = (DATALOADER, RNG)
"""Different on every rank: gathered and stored as ``rank_i`` entries."""
ALL_PARTS = SHARED_PARTS + PER_RANK_PARTS

# Keys of the CONFIG part.
TRAIN_CONFIG_KEY = "train_config"
DRAFT_CONFIG_KEY = "draft_config"
PROVENANCE_KEY = "provenance"  # peagle version, git revision, host facts of the training process

WEIGHTS_FINITE_KEY = "weights_finite"
"""``metadata.json``: True when every floating-point tensor of the model part is finite (no NaN, no
inf), False otherwise; absent in checkpoints of a peagle from before it was recorded. Rotation keeps
the newest checkpoint with finite weights (stages/train/checkpoint.py); export refuses non-finite ones."""

STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def part_file(key: str) -> str:
    """The file name of part ``key`` inside a checkpoint directory."""
    return f"{key}.pt"
