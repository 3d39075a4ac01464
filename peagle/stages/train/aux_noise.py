"""Noise on the target's aux states while training (``--aux-noise``).

A draft served in vLLM reads the target's real hidden states, but a 1-layer draft trained for many
epochs on a few hundred thousand tokens learns those states by heart: its agreement on the training
batches keeps rising while the held-out one stays flat (docs/quality.md, "Convergence"). EAGLE-1
trained on noised features; here the noise is relative (a fraction of each state's RMS, per row and
per aux layer), so one setting means the same for every target whatever its hidden states' scale.
"""

from __future__ import annotations

import torch
from torch import Tensor


def noised(aux_RAH: Tensor, scale: float) -> Tensor:
    """``aux_RAH`` plus N(0, (scale · rms)²) per element, rms taken over each state's hidden size H, in
    the states' dtype. Draws from torch's global RNG on the states' device (the trainer checkpoints
    it), so a resumed run draws the same noise."""
    states = aux_RAH.float()
    rms = states.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return (states + torch.randn_like(states) * (rms * scale)).to(aux_RAH.dtype)
