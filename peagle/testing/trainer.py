"""A trainer around a given draft, without stores or checkpoints: tests and benchmarks feed it batches.

They call ``train_step`` / ``step_fn.forward_backward`` / ``step_fn.evaluate`` with batches they
collate themselves; the config's paths are unused.
"""

from __future__ import annotations

import torch

from peagle.model.draft import PEagleDraft
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.loop import Trainer


def trainer_for_draft(config: TrainConfig, draft: PEagleDraft, *, compute_dtype: torch.dtype | None = None) -> Trainer:
    """The run's own trainer verbs (world, step) around ``draft``; ``compute_dtype`` overrides the
    device's default (bf16 autocast on CPU, in tests)."""
    trainer = Trainer(config)
    trainer.compute_dtype = compute_dtype
    trainer.setup_world()
    trainer.build_step(draft, config.max_steps or 1)
    return trainer
