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
    config's; with neither, float32 on a CPU (where a run's ``auto`` is bf16 on CPUs with native bf16
    matmuls), so the tests' equivalence checks compare exact math wherever they run."""
    trainer = Trainer(config)
    trainer.setup_world()
    if compute_dtype is not None:
        trainer.compute_dtype = compute_dtype
    elif config.compute_dtype == "auto" and trainer.device.type == "cpu":
        trainer.compute_dtype = torch.float32  # CPU tests compare exact math; a run's auto may be bf16 here
    trainer.build_step(draft, config.max_steps or 1)
    return trainer
