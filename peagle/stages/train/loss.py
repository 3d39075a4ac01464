"""Forward KL(target || draft) over the draft vocab from stored top-k targets (DESIGN §5).

The target distribution of an element is its stored top-k restricted to draft-vocab ids and
renormalised (the caller's job: it owns the store and the vocab map); everything outside those
ids has target probability 0 and contributes nothing. So per element only k draft logits are
gathered next to one log-sum-exp over the draft vocab: no dense [N, V] target is ever built.

The loss is returned as a *sum* over supervised elements: the trainer divides by one count of
supervised elements over the whole global batch (all ranks, micro-batches and segments), so that
segment and micro-batch splits do not change the loss or its gradient (STYLE smell 6).

Shape letters: N elements, V draft vocab, k top-k, K depths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class KLStats:
    """Sums for one forward; every field is a tensor so that nothing syncs with the host here.

    ``loss_sum`` carries the gradient. Per depth (``[K]``): ``depth_loss_sum`` (detached),
    ``depth_correct`` (draft argmax == target argmax, supervised elements only) and
    ``depth_count`` (supervised elements). ``num_uncovered`` counts elements the caller marked
    supervised but whose top-k has no draft-vocab id: they are dropped from loss and counts.
    """

    loss_sum: Tensor
    depth_loss_sum: Tensor
    depth_correct: Tensor
    depth_count: Tensor
    num_uncovered: Tensor


def forward_kl_sum(draft_logits_NV: Tensor, target_draft_ids_Nk: Tensor, target_probs_Nk: Tensor,
                   supervised_N: Tensor, depth_N: Tensor, num_depths: int) -> KLStats:
    """Σ over supervised elements of KL(p ‖ softmax(draft_logits)), with per-depth statistics.

    Args:
        draft_logits_NV: draft logits over the draft vocab (any float dtype; reduced in fp32).
        target_draft_ids_Nk: the target's top-k ids mapped to draft indices, -1 where not in the draft
            vocab. Column 0 must be the target's argmax (top-k sorted descending, as stored), so an
            element whose argmax is outside the draft vocab can never count as correct.
        target_probs_Nk: target probabilities renormalised over the in-vocab ids (0 at -1 ids).
        supervised_N: bool mask (or float weights: the KL is weighted, counts use weight > 0).
        depth_N: int depth of each element, in ``[0, num_depths)``.
        num_depths: K, the length of the per-depth statistics.
    """
    ids_Nk = target_draft_ids_Nk.long()
    in_vocab_Nk = ids_Nk >= 0
    covered_N = in_vocab_Nk.any(dim=-1)
    weight_N = supervised_N.float()
    counted_N = (weight_N > 0) & covered_N
    weight_N = torch.where(counted_N, weight_N, torch.zeros_like(weight_N))

    logits32_NV = draft_logits_NV.float()
    lse_N = torch.logsumexp(logits32_NV, dim=-1)
    draft_logp_Nk = logits32_NV.gather(1, ids_Nk.clamp_min(0)) - lse_N[:, None]
    p_Nk = torch.where(in_vocab_Nk, target_probs_Nk.float(), torch.zeros_like(draft_logp_Nk))
    # KL = Σ p log p - Σ p log q; xlogy makes p = 0 terms exactly 0 (no 0 · -inf).
    kl_N = (torch.xlogy(p_Nk, p_Nk) - p_Nk * draft_logp_Nk).sum(dim=-1)
    weighted_kl_N = kl_N * weight_N

    correct_N = counted_N & (draft_logits_NV.argmax(dim=-1) == ids_Nk[:, 0])
    depth_N = depth_N.long()
    zeros_K = torch.zeros(num_depths, dtype=torch.float32, device=draft_logits_NV.device)
    return KLStats(
        loss_sum=weighted_kl_N.sum(),
        depth_loss_sum=zeros_K.index_add(0, depth_N, weighted_kl_N.detach()),
        depth_correct=zeros_K.index_add(0, depth_N, correct_N.float()),
        depth_count=zeros_K.index_add(0, depth_N, counted_N.float()),
        num_uncovered=((supervised_N.float() > 0) & ~covered_N).sum(),
    )


def forward_kl_sum_chunked(compute_logits: Callable[[Tensor], Tensor], hidden_NH: Tensor,
                           target_draft_ids_Nk: Tensor, target_probs_Nk: Tensor, supervised_N: Tensor,
                           depth_N: Tensor, num_depths: int, *, chunk_size: int = 4096) -> KLStats:
    """`forward_kl_sum` of ``compute_logits(hidden_NH)``, ``chunk_size`` rows at a time.

    Each chunk's logits (and their fp32 copy) are dropped after its forward and recomputed in the
    backward (activation checkpointing), so the peak holds one chunk of ``[chunk, V]`` instead of
    ``[N, V]`` -- about 5 GiB less at N = 27k, V = 32k. Sums, and so gradients, equal the unchunked
    call to float tolerance. Pass only the rows that need a loss (supervised elements).
    """

    def chunk_stats(hidden, ids, probs, supervised, depth):
        return forward_kl_sum(compute_logits(hidden), ids, probs, supervised, depth, num_depths)

    parts = []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        args = (hidden_NH[rows], target_draft_ids_Nk[rows], target_probs_Nk[rows], supervised_N[rows], depth_N[rows])
        parts.append(checkpoint(chunk_stats, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else chunk_stats(*args))
    if not parts:
        return forward_kl_sum(compute_logits(hidden_NH), target_draft_ids_Nk, target_probs_Nk,
                              supervised_N, depth_N, num_depths)
    return KLStats(*(torch.stack([getattr(p, f) for p in parts]).sum(0) for f in KLStats.__dataclass_fields__))


def acceptance_length_estimate(per_depth_agreement: Sequence[float] | Tensor) -> float:
    """Chain estimate of mean accepted length from per-depth top-1 agreement rates a_0 .. a_{K-1}.

    ``AL ≈ 1 + Σ_d Π_{j<=d} a_j``: the bonus token is always accepted, and depth d's draft is
    accepted when it and every shallower draft agree with the target's argmax. Depth d here is
    DESIGN §5's draft_{d+1}. It treats the per-depth agreements as independent; the exact
    ``AL(K)`` (evaluation: full chains, per-anchor products) is higher when errors are correlated,
    so compare estimates only with estimates. A depth with no data (NaN rate) ends the chain.
    """
    rates = torch.as_tensor(per_depth_agreement, dtype=torch.float64).nan_to_num(0.0)
    return float(1.0 + torch.cumprod(rates, dim=0).sum())


def agreement_rates(depth_correct: Tensor, depth_count: Tensor) -> Tensor:
    """Per-depth agreement ``correct / count`` (NaN where a depth had no supervised element)."""
    count = depth_count.double()
    return torch.where(count > 0, depth_correct.double() / count.clamp_min(1), torch.full_like(count, float("nan")))
