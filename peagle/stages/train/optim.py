"""The optimizer side of a step: AdamW or Muon+AdamW, the gradient norm and clip, the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.schemas.optimizer_settings import OptimizerSettings
from peagle.stages.train.device import uses_fused_optimizer

MIN_LR_RATIO = 0.1


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``MIN_LR_RATIO`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def gradient_norm(params: list[Tensor]) -> Tensor:
    """The global L2 norm of the parameters' gradients, on the device (no host read)."""
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).detach()


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[Tensor], max_norm: float,
                  norm: Tensor | None = None) -> Tensor | None:
    """Clip the global gradient norm to ``max_norm`` (0: no clip) and step; returns the norm before
    clipping (as ``clip_grad_norm_`` does; ``norm`` when the caller computed it already, None without
    a clip and a norm), on the device, without a host sync.

    A fused AdamW takes the clip as its ``grad_scale`` (the divisor GradScaler hands it): the kernel
    divides each gradient by ``max(1, norm / max_norm)`` as it reads it, so the separate pass that
    scales every gradient in place is saved (the gradients themselves stay unclipped; the next step
    zeroes them). Any other optimizer gets ``clip_grad_norm_``'s two halves. Both give the same update
    (tests/stages/train/test_step.py).
    """
    if max_norm <= 0:
        optimizer.step()
        return norm
    norm = gradient_norm(params) if norm is None else norm
    fused = all(group.get("fused") for group in optimizer.param_groups) and isinstance(optimizer, torch.optim.AdamW)
    if not fused:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        optimizer.step()
        return norm
    # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); this divides by its inverse.
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm


def build_optimizer(draft: PEagleDraft, config: OptimizerSettings, device: torch.device,
                    fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable fp32 parameters; weight decay on matrices only (not norms, embeddings
    or ``mask_hidden``, which is an input rather than a weight). Fused on CUDA.

    ``--optimizer muon``: :class:`MuonAdamW` with the same decay split, Muon at ``--muon-lr`` on the
    decoder layers' matrices and AdamW at ``--lr`` on the rest (muon.py says why each goes where).
    Every group keeps its own base rate, so the LambdaLR schedule scales both by one factor and
    keeps their ratio. Under DDP every rank holds the whole, already all-reduced gradient before
    the step, so Muon's Newton-Schulz runs on identical matrices and the replicas stay identical;
    FSDP2 shards are refused by the config (TrainConfig). ``fused`` (default: on CUDA) makes AdamW one
    fused kernel, into which :func:`clip_and_step` folds the gradient clip. Built from the run's
    optimizer part alone (``TrainConfig.optim``): a new optimizer knob is a field there, used here."""
    if config.optimizer == "muon":
        from peagle.stages.train.muon import MuonAdamW, muon_param_groups

        groups = muon_param_groups(draft, muon_lr=config.muon_lr, adamw_lr=config.lr,
                                   weight_decay=config.weight_decay)
        return MuonAdamW(groups, lr=config.lr, muon_lr=config.muon_lr, betas=(0.9, 0.95), eps=1e-8,
                         ns_dtype=getattr(torch, config.muon_ns_dtype))
    fused = uses_fused_optimizer(device) if fused is None else fused
    decay, no_decay = [], []
    for name, p in draft.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() == 2 and not name.startswith("embed_tokens") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
