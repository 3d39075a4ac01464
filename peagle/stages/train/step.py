"""The parts of one training step that hold no run state: units, the unit forward, stats, optimizer.

A *unit* is one forward+backward: a whole micro-batch (S = 1) or one segment of it (S > 1, DESIGN §4).
Segment bookkeeping (which elements a segment carries, which supervised targets it charges) is done
on the CPU batch, before the copy to the device; the device only gathers with those indices.

The stats of a unit are one flat vector, so that summing units, steps and ranks is one ``+=`` or
one ``all_reduce``: ``[loss_sum, num_uncovered, depth_loss_sum[K], depth_correct[K], depth_count[K]]``.

Shape letters as in batch.py: T positions, N flat elements, M a unit's elements, R its real (depth-0)
rows, E supervised elements, K depths, V draft vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from peagle.model.draft import PEagleDraft
from peagle.model.mask import block_mask_from_indices, create_peagle_mask_mod, dense_peagle_mask
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.batch import TrainBatch
from peagle.stages.train.loss import acceptance_length_estimate, agreement_rates, forward_kl_sum

MIN_LR_RATIO = 0.1


class DraftStep(nn.Module):
    """Draft forward + logits at the supervised rows only, as ONE module forward.

    DDP and FSDP2 hook into ``forward``: logits computed outside it would miss their gradient sync.
    Only the E supervised rows reach ``lm_head`` (the big matmul): DESIGN §8.
    """

    def __init__(self, draft: PEagleDraft):
        super().__init__()
        self.draft = draft

    def forward(self, token_ids_M: Tensor, aux_RAH: Tensor, position_ids_M: Tensor, attn_mask: Any,
                supervised_idx_E: Tensor) -> Tensor:
        hidden_MH = self.draft(token_ids_M, aux_RAH, position_ids_M, attn_mask)
        return self.draft.compute_logits(hidden_MH[supervised_idx_E])


@dataclass
class Unit:
    """One forward+backward's inputs (tensors on the training device).

    ``element_idx_M`` selects the unit's elements from the batch's flat sequence (None: all of them);
    its first ``num_real`` are depth-0 elements, whose flat index is their row position (batch.py), so
    they also index ``aux_TAH``. ``target_idx_E`` selects the batch's supervised targets this unit
    charges (None: all); ``supervised_idx_E`` are their rows inside the unit.
    """

    batch: TrainBatch
    element_idx_M: Tensor | None
    num_real: int
    supervised_idx_E: Tensor
    target_idx_E: Tensor | None
    block_indices: Any


def plan_units(batch: TrainBatch) -> list[dict[str, Any]]:
    """The units of one CPU batch as index tensors; segments that carry nothing are skipped."""
    if batch.segments is None:
        return [dict(element_idx_M=None, num_real=batch.num_tokens, supervised_idx_E=batch.supervised_idx_E,
                     target_idx_E=None, block_indices=batch.block_indices)]
    units = []
    for s, seg in enumerate(batch.segments):
        idx_M = seg.indices
        if idx_M.numel() == 0:
            continue
        # Where each supervised element sits in the segment, and whether the segment owns it.
        pos_E = torch.searchsorted(idx_M, batch.supervised_idx_E).clamp(max=idx_M.numel() - 1)
        charged_E = (idx_M[pos_E] == batch.supervised_idx_E) & seg.owned[pos_E]
        target_idx_E = torch.nonzero(charged_E).flatten()
        units.append(dict(
            element_idx_M=idx_M, num_real=int(torch.searchsorted(idx_M, batch.num_tokens)),
            supervised_idx_E=pos_E[target_idx_E], target_idx_E=target_idx_E,
            block_indices=None if batch.segment_block_indices is None else batch.segment_block_indices[s]))
    return units


def to_units(batch: TrainBatch, device: torch.device) -> list[Unit]:
    """Plan on the CPU, then copy the batch and the index tensors to ``device`` (non-blocking)."""
    plans = plan_units(batch)
    on_device = batch.to(device, non_blocking=True)

    def move(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return [Unit(batch=on_device, element_idx_M=move(p["element_idx_M"]), num_real=p["num_real"],
                 supervised_idx_E=move(p["supervised_idx_E"]), target_idx_E=move(p["target_idx_E"]),
                 block_indices=p["block_indices"]) for p in plans]


def unit_forward(model: nn.Module, unit: Unit, *, attention: str, num_depths: int, device: torch.device):
    """The unit's logits at its charged elements and their KL sums (``KLStats``; ``loss_sum`` has grad)."""
    b, idx = unit.batch, unit.element_idx_M

    def pick(t: Tensor) -> Tensor:
        return t if idx is None else t[idx]

    def charged(t: Tensor) -> Tensor:
        return t if unit.target_idx_E is None else t[unit.target_idx_E]

    anchor_M, depth_M = pick(b.anchor_N), pick(b.depth_N)
    aux_RAH = b.aux_states(None if idx is None else idx[: unit.num_real])  # fp8: dequantised here, on the device
    if attention == "flex":
        mask_mod = create_peagle_mask_mod(anchor_M, depth_M, b.doc_lengths_D, b.num_tokens)
        attn_mask = block_mask_from_indices(unit.block_indices, mask_mod, device=device)
    else:
        attn_mask = dense_peagle_mask(anchor_M, depth_M, b.doc_lengths_D, b.num_tokens)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits_EV = model(pick(b.input_ids_N), aux_RAH, pick(b.position_ids_N), attn_mask, unit.supervised_idx_E)
        depth_E = charged(b.depth_E)
        return forward_kl_sum(logits_EV, charged(b.target_ids_Ek), charged(b.target_probs_Ek),
                              torch.ones_like(depth_E, dtype=torch.bool), depth_E, num_depths)


def stats_vector(stats) -> Tensor:
    """A unit's KLStats as the flat stats vector (module docstring), detached."""
    return torch.cat([stats.loss_sum.detach().float()[None], stats.num_uncovered.float()[None],
                      stats.depth_loss_sum, stats.depth_correct, stats.depth_count])


def summarise(stats: Tensor, num_depths: int) -> dict[str, Any]:
    """Loss over the supervised count, per-depth loss / agreement / count, and the AL estimate."""
    stats = stats.detach().double().cpu()
    K = num_depths
    loss_K, correct_K, count_K = stats[2:2 + K], stats[2 + K:2 + 2 * K], stats[2 + 2 * K:]
    agreement = agreement_rates(correct_K, count_K)
    return {
        "loss": float(stats[0]) / max(float(count_K.sum()), 1.0),
        "depth_loss": [float(l / c) if c > 0 else None for l, c in zip(loss_K, count_K)],
        "depth_agreement": [None if math.isnan(a) else float(a) for a in agreement],
        "depth_count": [int(c) for c in count_K],
        "acceptance_length_estimate": acceptance_length_estimate(agreement),
        "num_uncovered": int(stats[1]),
    }


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``MIN_LR_RATIO`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(draft: PEagleDraft, config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable fp32 parameters; weight decay on matrices only (not norms, embeddings
    or ``mask_hidden``, which is an input rather than a weight). Fused on CUDA."""
    decay, no_decay = [], []
    for name, p in draft.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() == 2 and not name.startswith("embed_tokens") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
