"""The training loss over the draft vocab from stored top-k targets (docs/draft-and-export.md, docs/loss.md).

The target distribution of an element is its stored top-k restricted to draft-vocab ids and
renormalised (the caller's job: it owns the store and the vocab map); everything outside those
ids has target probability 0. So per element only k draft logits are gathered next to one
log-sum-exp over the draft vocab: no dense [N, V] target is ever built. Two losses
(``ELEMENT_LOSSES``, ``--loss``): forward KL(target || draft), where ids of target probability 0
contribute nothing, and total variation ``½ Σ_v |p_v - q_v|``, whose sum over the ids outside the top-k is the draft's mass
there, ``1 - Σ_k q``: both need only the k gathered probabilities and the log-sum-exp.

The loss is returned as a *sum* over supervised elements: the trainer divides by one count of
supervised elements over the whole global batch (all ranks, micro-batches and segments), so that
segment and micro-batch splits do not change the loss or its gradient.

The same record carries the exact acceptance length of the batches' complete COD chains
(:func:`chain_acceptance`): per-row top-1 agreement is reduced per chain to accepted drafts, on the
device, where an element without a usable target rejects (docs/draft-and-export.md).

Shape letters: N elements, V draft vocab, k top-k, K depths, E a batch's targets, C its chains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class LossStats:
    """Sums for one forward (or, added up, a step, a logging window); every field is a tensor so that
    nothing syncs with the host. It is the train step's stats record (step.py).

    ``loss_sum`` carries the gradient. Per depth (``[K]``): ``depth_loss_sum`` (detached),
    ``depth_correct`` (draft argmax == target argmax, supervised elements only) and
    ``depth_count`` (supervised elements). Per chain (:func:`chain_acceptance`, filled per batch by
    the step, zero in a single forward's record): ``chain_accepted_sum``, the drafts accepted over
    the batch's complete chains, and ``chain_count``, those chains; the exact acceptance length
    of those chains is ``1 + chain_accepted_sum / chain_count`` (:func:`chain_acceptance_length`).
    """

    loss_sum: Tensor
    depth_loss_sum: Tensor
    depth_correct: Tensor
    depth_count: Tensor
    chain_accepted_sum: Tensor
    chain_count: Tensor

    @classmethod
    def zeros(cls, num_depths: int, device: torch.device | str | None = None) -> "LossStats":
        return cls(torch.zeros((), device=device), *(torch.zeros(num_depths, device=device) for _ in range(3)),
                   torch.zeros((), device=device), torch.zeros((), device=device))

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(*(a + b for a, b in zip(self._fields(), other._fields())))

    def detach(self) -> "LossStats":
        """Detached float32 copy: the form sums over units, steps and ranks take."""
        return LossStats(*(t.detach().float() for t in self._fields()))

    @property
    def num_depths(self) -> int:
        return int(self.depth_count.numel())

    def to_vector(self) -> Tensor:
        """``[loss_sum, chain_accepted_sum, chain_count, depth_loss_sum[K], depth_correct[K], depth_count[K]]``
        (detached, float32): one tensor, so that a rank sum is one ``all_reduce`` and a checkpoint holds
        one entry."""
        d = self.detach()
        return torch.cat([d.loss_sum[None], d.chain_accepted_sum[None], d.chain_count[None], d.depth_loss_sum,
                          d.depth_correct, d.depth_count])

    @classmethod
    def from_vector(cls, vector: Tensor, num_depths: int) -> "LossStats":
        """Inverse of :meth:`to_vector` (the one place that knows the layout).

        ``num_depths`` is required: a vector of another layout (an older peagle's checkpointed
        logging window, ``2 + 3K`` long, without the chain sums) must not be read as this one.

        Raises:
            ValueError: when the vector is not ``3 + 3·num_depths`` long.
        """
        K = num_depths
        if vector.dim() != 1 or vector.numel() != 3 + 3 * K:
            raise ValueError(f"a stats vector for {K} depths has {3 + 3 * K} entries "
                             f"([loss, chain sums, 3 x {K} per-depth sums]), this one has {vector.numel()}")
        return cls(vector[0], vector[3:3 + K], vector[3 + K:3 + 2 * K], vector[3 + 2 * K:], vector[1], vector[2])

    def _fields(self) -> tuple[Tensor, ...]:
        return (self.loss_sum, self.depth_loss_sum, self.depth_correct, self.depth_count, self.chain_accepted_sum,
                self.chain_count)


def _forward_kl_N(p_Nk: Tensor, draft_logp_Nk: Tensor, in_vocab_Nk: Tensor) -> Tensor:
    """KL = Σ p log p - Σ p log q; xlogy makes p = 0 terms exactly 0 (no 0 · -inf)."""
    return (torch.xlogy(p_Nk, p_Nk) - p_Nk * draft_logp_Nk).sum(dim=-1)


def _total_variation_N(p_Nk: Tensor, draft_logp_Nk: Tensor, in_vocab_Nk: Tensor) -> Tensor:
    """TV = ½ (Σ_k |p - q| + Σ_{v outside the k} q_v), the second sum being ``1 - Σ_k q``: exact,
    since p is 0 outside the k in-vocab ids. Its gradient reaches every draft logit through the
    log-sum-exp. Columns of id -1 hold p = 0 and are masked out of q."""
    q_Nk = torch.where(in_vocab_Nk, draft_logp_Nk.exp(), torch.zeros_like(draft_logp_Nk))
    return 0.5 * ((p_Nk - q_Nk).abs().sum(dim=-1) + (1.0 - q_Nk.sum(dim=-1)))


ELEMENT_LOSSES: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "forward_kl": _forward_kl_N, "tv": _total_variation_N}
"""Per-element loss from (target probs, draft log-probs at the k ids, in-vocab mask), all ``[N, k]``."""


def divergence_sum(draft_logits_NV: Tensor, target_draft_ids_Nk: Tensor, target_probs_Nk: Tensor,
                   supervised_N: Tensor, depth_N: Tensor, num_depths: int, loss: str = "forward_kl") -> LossStats:
    """Σ over supervised elements of ``loss``(p, softmax(draft_logits)), with per-depth statistics.

    Args:
        draft_logits_NV: draft logits over the draft vocab (any float dtype; reduced in fp32).
        target_draft_ids_Nk: the target's top-k ids mapped to draft indices, -1 where not in the draft
            vocab. Column 0 must be the target's argmax (top-k sorted descending, as stored), so an
            element whose argmax is outside the draft vocab can never count as correct.
        target_probs_Nk: target probabilities renormalised over the in-vocab ids (0 at -1 ids).
        supervised_N: bool mask (or float weights: the KL is weighted, counts use weight > 0).
            A supervised element none of whose ids is in the draft vocab has no target: it is left
            out of the loss and the counts (the trainer's ``collate`` drops such elements before
            the loss and counts them as ``num_no_target``).
        depth_N: int depth of each element, in ``[0, num_depths)``.
        num_depths: K, the length of the per-depth statistics.
        loss: a key of ``ELEMENT_LOSSES``; ``depth_loss_sum`` holds the same loss.
    """
    return _divergence_terms(draft_logits_NV, target_draft_ids_Nk, target_probs_Nk, supervised_N, depth_N,
                             num_depths, loss)[0]


def _divergence_terms(draft_logits_NV: Tensor, target_draft_ids_Nk: Tensor, target_probs_Nk: Tensor,
                      supervised_N: Tensor, depth_N: Tensor, num_depths: int, loss: str) -> tuple[LossStats, Tensor]:
    """`divergence_sum` and the per-element ``correct_N`` (bool) its ``depth_correct`` sums: the chain
    statistics need which elements agree, not only how many per depth."""
    element_loss = ELEMENT_LOSSES[loss]
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
    kl_N = element_loss(p_Nk, draft_logp_Nk, in_vocab_Nk)
    weighted_kl_N = kl_N * weight_N

    correct_N = counted_N & (draft_logits_NV.argmax(dim=-1) == ids_Nk[:, 0])
    depth_N = depth_N.long()
    zeros_K = torch.zeros(num_depths, dtype=torch.float32, device=draft_logits_NV.device)
    zero = torch.zeros((), dtype=torch.float32, device=draft_logits_NV.device)
    stats = LossStats(
        loss_sum=weighted_kl_N.sum(),
        depth_loss_sum=zeros_K.index_add(0, depth_N, weighted_kl_N.detach()),
        depth_correct=zeros_K.index_add(0, depth_N, correct_N.float()),
        depth_count=zeros_K.index_add(0, depth_N, counted_N.float()),
        chain_accepted_sum=zero, chain_count=zero,
    )
    return stats, correct_N


DEFAULT_CHUNK_ROWS = 4096
"""Rows per loss chunk: ``[4096, 32000]`` logits are 0.25 GiB in bf16, and lm_head still runs as big matmuls."""

ChunkFn = Callable[[Tensor, Tensor, Tensor, str], tuple[Tensor, Tensor]]
"""``fn(logits_cV, ids_ck, probs_ck, loss) -> (row_loss_c, correct_c)``, the logits overwritten by their
gradient: :func:`fused_chunk_loss`, or its ``torch.compile``'d form (step.py decides)."""


def fused_chunk_loss(logits_cV: Tensor, ids_ck: Tensor, probs_ck: Tensor, loss: str) -> tuple[Tensor, Tensor]:
    """One chunk's loss in one pass: each row's loss (fp32, 0 for a row without target), its top-1
    agreement, and d(Σ rows' loss)/d(logits) written over ``logits_cV`` in its own dtype.

    Both losses have a gradient of one closed form, ``a_n · softmax(z_n) + Σ_k b_nk · onehot(id_nk)``
    (forward KL: ``a = Σ_k p``, ``b = -p``; TV: with ``c = ½(sign(q - p) - 1)·q``, ``a = -Σ_k c``,
    ``b = c``), so nothing but the row's log-sum-exp, its k gathered logits and its argmax is needed
    before the gradient is written. Eager, this is a few passes with an fp32 copy of the chunk;
    compiled (the trainer does it on CUDA), Inductor fuses the upcast, log-sum-exp, argmax and the
    gradient into passes that read the bf16 logits and write the gradient in place.
    Equal to :func:`divergence_sum` plus autograd (tests/stages/train/test_loss.py).
    """
    ids_ck = ids_ck.long()
    in_vocab_ck = ids_ck >= 0
    weight_c = in_vocab_ck.any(dim=-1).float()
    safe_ids_ck = ids_ck.clamp_min(0)
    logits32_cV = logits_cV.float()
    lse_c = torch.logsumexp(logits32_cV, dim=-1)
    correct_c = (weight_c > 0) & (logits_cV.argmax(dim=-1) == ids_ck[:, 0])
    logp_ck = logits32_cV.gather(1, safe_ids_ck) - lse_c[:, None]
    p_ck = torch.where(in_vocab_ck, probs_ck.float(), torch.zeros_like(logp_ck))
    if loss == "forward_kl":
        row_c = _forward_kl_N(p_ck, logp_ck, in_vocab_ck)
        a_c, b_ck = p_ck.sum(dim=-1), -p_ck
    elif loss == "tv":
        q_ck = torch.where(in_vocab_ck, logp_ck.exp(), torch.zeros_like(logp_ck))
        row_c = _total_variation_N(p_ck, logp_ck, in_vocab_ck)
        c_ck = 0.5 * (torch.sign(q_ck - p_ck) - 1.0) * q_ck
        a_c, b_ck = -c_ck.sum(dim=-1), c_ck
    else:
        raise ValueError(f"unknown loss {loss!r}")
    grad_cV = torch.exp(logits32_cV - lse_c[:, None]) * (weight_c * a_c)[:, None]
    grad_cV = grad_cV.scatter_add(1, safe_ids_ck, b_ck * weight_c[:, None])
    logits_cV.copy_(grad_cV)
    return row_c * weight_c, correct_c


def matmul_dtype(head_weight_VH: Tensor) -> torch.dtype:
    """The dtype the loss's matmuls run in: autocast's when it is on for the head's device (bf16 on
    CUDA), else the head's own."""
    device_type = head_weight_VH.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else head_weight_VH.dtype


def compute_weight(head_weight_VH: Tensor) -> Tensor:
    """The head weight as the loss's matmuls read it (:func:`matmul_dtype`), detached (the loss
    returns the head's gradient itself)."""
    return head_weight_VH.detach().to(matmul_dtype(head_weight_VH))


def chunked_loss_sum(hidden_EH: Tensor, head_weight_VH: Tensor, target_draft_ids_Ek: Tensor, target_probs_Ek: Tensor,
                     depth_E: Tensor, num_depths: int, *, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                     loss: str = "forward_kl", head_compute_VH: Tensor | None = None,
                     chunk_fn: ChunkFn | None = None) -> tuple[LossStats, Tensor]:
    """`divergence_sum` of ``hidden_EH @ head_weight_VHᵀ`` (every row supervised), ``chunk_rows`` rows at a
    time, and each row's top-1 agreement ``correct_E`` (bool, no gradient: the chain statistics).

    Peak memory holds one chunk's ``[chunk, V]`` logits (which become their own gradient,
    :func:`fused_chunk_loss`), never ``[E, V]`` (~20 GB at E = 55k, V = 32k): each chunk's gradient
    with respect to ``hidden_EH`` (and to the head, when it trains) is computed right after its
    forward; what backward keeps is ``[E, H]`` (plus ``[V, H]`` for a trained head). The loss is
    linear in those gradients, so backward only scales them by the incoming gradient. The sums and
    gradients are the unchunked ones (the same math per row; only the head's gradient adds chunk
    partial sums in another order). The matmuls read the head in the autocast dtype
    (:func:`compute_weight`): ``head_compute_VH`` passes that copy in (the trainer keeps one of a
    frozen head instead of casting it for every chunk). ``chunk_fn`` is the per-chunk pass
    (default :func:`fused_chunk_loss`, eager). ``loss`` (forward KL by default, or TV) changes none
    of this: each is a sum of per-row terms.

    Call it where the head's gradient must reach DDP/FSDP: inside the wrapped module's forward
    (``step.DraftStep``); its weight gradient is returned through autograd like any other.
    """
    if not (torch.is_grad_enabled() and (hidden_EH.requires_grad or head_weight_VH.requires_grad)):
        with torch.no_grad():
            return _chunk_sums(hidden_EH, head_weight_VH, target_draft_ids_Ek, target_probs_Ek, depth_E, num_depths,
                               chunk_rows, loss)
    head_compute_VH = compute_weight(head_weight_VH) if head_compute_VH is None else head_compute_VH.detach()
    loss_sum, *stats, correct_E = _ChunkedKL.apply(hidden_EH, head_weight_VH, head_compute_VH, target_draft_ids_Ek,
                                                   target_probs_Ek, depth_E, num_depths, chunk_rows, loss,
                                                   chunk_fn or fused_chunk_loss)
    zero = torch.zeros_like(loss_sum.detach())
    return LossStats(loss_sum, *stats, chain_accepted_sum=zero, chain_count=zero), correct_E


def _chunk_sums(hidden_EH, weight_VH, ids_Ek, probs_Ek, depth_E, num_depths, chunk_rows, loss) -> tuple[LossStats, Tensor]:
    """Per-chunk `divergence_sum`, summed, and the rows' ``correct_E`` (no gradient: evaluation)."""
    total = LossStats.zeros(num_depths, hidden_EH.device)
    correct = [torch.zeros(0, dtype=torch.bool, device=hidden_EH.device)]
    for start in range(0, hidden_EH.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        stats, correct_c = _divergence_terms(F.linear(hidden_EH[rows], weight_VH), ids_Ek[rows], probs_Ek[rows],
                                             torch.ones_like(depth_E[rows], dtype=torch.bool), depth_E[rows],
                                             num_depths, loss)
        total = total + stats.detach()
        correct.append(correct_c)
    return total, torch.cat(correct)


class _ChunkedKL(torch.autograd.Function):
    """Forward computes the sums and, chunk by chunk, d(loss_sum)/d(hidden, weight); backward scales them."""

    @staticmethod
    def forward(ctx, hidden_EH, weight_VH, compute_VH, ids_Ek, probs_Ek, depth_E, num_depths, chunk_rows, loss,
                chunk_fn):
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        device = hidden_EH.device
        grad_hidden_EH = torch.empty_like(hidden_EH) if want_hidden else None  # every row is written
        # The head's gradient adds up over chunks: in fp32, whatever the weight's (FSDP2: bf16) dtype.
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32) if want_weight else None
        depth_E = depth_E.long()
        counted_E = (ids_Ek >= 0).any(dim=-1).float()
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        depth_loss_K, depth_correct_K, depth_count_K = (torch.zeros(num_depths, device=device) for _ in range(3))
        depth_count_K.index_add_(0, depth_E, counted_E)
        correct = [torch.zeros(0, dtype=torch.bool, device=device)]
        for start in range(0, hidden_EH.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            hidden_cH = hidden_EH[rows].detach().to(compute_VH.dtype)
            logits_cV = hidden_cH @ compute_VH.T
            row_c, correct_c = chunk_fn(logits_cV, ids_Ek[rows], probs_Ek[rows], loss)  # logits -> gradient
            if want_hidden:
                grad_hidden_EH[rows] = logits_cV @ compute_VH
            if want_weight:
                grad_weight_VH.add_(logits_cV.T @ hidden_cH)
            loss_sum = loss_sum + row_c.sum()
            depth_loss_K.index_add_(0, depth_E[rows], row_c)
            depth_correct_K.index_add_(0, depth_E[rows], correct_c.float())
            correct.append(correct_c)
        ctx.save_for_backward(grad_hidden_EH, grad_weight_VH)
        ctx.weight_dtype = weight_VH.dtype
        outputs = (depth_loss_K, depth_correct_K, depth_count_K, torch.cat(correct))
        ctx.mark_non_differentiable(*outputs)
        return (loss_sum, *outputs)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_hidden_EH, grad_weight_VH = ctx.saved_tensors
        grad_weight = None if grad_weight_VH is None else (grad_weight_VH * grad_loss).to(ctx.weight_dtype)
        grad_hidden = None if grad_hidden_EH is None else grad_hidden_EH * grad_loss.to(grad_hidden_EH.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def chain_acceptance(correct_E: Tensor, chain_target_idx_CK: Tensor) -> LossStats:
    """The chain sums of one batch: drafts accepted over its C complete chains, and C.

    ``correct_E`` is the top-1 agreement of each of the batch's E targets (the units' ``correct_e``
    put back in target order); ``chain_target_idx_CK`` (``TrainBatch``, built by the loader) names
    the target of chain c's depth-d element, or E where that element has no usable target. A chain
    accepts its leading run of agreeing drafts, ``Σ_d Π_{j<=d} correct[c, j]``, the offline
    evaluator's count for the same chain (docs/draft-and-export.md); index E reads an appended
    False, so an element without a target rejects, and stops its chain, as verification would.
    Gathers and a cumprod only: no host sync.
    """
    correct_E1 = torch.cat([correct_E.bool(), correct_E.new_zeros(1, dtype=torch.bool)])
    accepted_C = correct_E1[chain_target_idx_CK].float().cumprod(dim=1).sum(dim=1)
    K = chain_target_idx_CK.shape[1]
    zeros = LossStats.zeros(K, correct_E.device)
    return LossStats(zeros.loss_sum, zeros.depth_loss_sum, zeros.depth_correct, zeros.depth_count,
                   chain_accepted_sum=accepted_C.sum(),
                   chain_count=torch.full((), chain_target_idx_CK.shape[0], dtype=torch.float32,
                                          device=correct_E.device))


def chain_acceptance_length(chain_accepted_sum: float, chain_count: float) -> float | None:
    """``1 + accepted / chains``: the exact mean acceptance length of the chains summed (the bonus token
    always counts); None without chains."""
    return 1.0 + chain_accepted_sum / chain_count if chain_count > 0 else None


def agreement_rates(depth_correct: Tensor, depth_count: Tensor) -> Tensor:
    """Per-depth agreement ``correct / count`` (NaN where a depth had no supervised element)."""
    count = depth_count.double()
    return torch.where(count > 0, depth_correct.double() / count.clamp_min(1), torch.full_like(count, float("nan")))
