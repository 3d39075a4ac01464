"""How often `peagle train` checkpoints and how many it keeps: the ``checkpoint`` part of ``TrainConfig``.

The layout of a checkpoint on disk is :mod:`peagle.schemas.checkpoint`; this is what a run asks of
its checkpointer (``stages/train/checkpoint.Checkpointer``). Both fields only steer when and how many,
never what a step computes, so a resumed run may change them (``train_resume.SAFE_TO_CHANGE``).
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.errors import at_least


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """When a run writes a checkpoint and which ones rotation keeps."""

    save_every: int = 1000
    """Write a checkpoint every this many optimizer steps, and at the end (0: only at the end)."""

    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep (older ones are deleted once a new one commits); the
    newest checkpoint whose weights are all finite is kept as well, however old."""

    def __post_init__(self) -> None:
        at_least("save_every", self.save_every, 0)
        at_least("keep_checkpoints", self.keep_checkpoints, 1)
