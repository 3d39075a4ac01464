"""Offline acceptance: teacher-forced full chains on held-out store samples (docs/draft-and-export.md).

For one sample ``x_0 … x_{n−1}``, read in training coordinates (docs/indexing.md, by the store reader
:mod:`peagle.pipeline.store_reader`: T = n − 1 positions, ``m[p] = loss_mask[p+2]``) every anchor
p whose whole chain is supervised (``m[p] = … = m[p+K−1] = 1``; this is the set COD's chains are
drawn from, without subsampling) gets all K drafts: a P-EAGLE draft in one draft forward, the
depth-0 element at p (real token ``x_{p+1}``, ``aux[p]``) and mask elements at p+1 … p+K−1, under
the training attention rule (``peagle.model.mask``), which the proposer parity test equates with
vLLM's parallel drafting; an EAGLE-3 draft in K sequential steps (``peagle.model.sequential.unroll``,
vLLM's eagle3 drafting), depth d fed the target's greedy token for ``x_{p+d+1}``: a chain counts
only while its drafts equal those tokens, so this is exactly what greedy verification sees.
Draft j (j = 1..K, depth j−1) at reference position q = p + j − 1 is compared with the target's
argmax for ``x_{q+2}`` (the top-1 of ``topk[q+1]``, the sample's ``topk_*_Tk[q]``). A chain counts
as accepted through depth d when its first d drafts all match, which is what greedy verification
would accept; the histogram goes to :mod:`peagle.stages.eval.acceptance` for AL(k), k = 1..K.

Cost: one forward per chunk of anchors over all depth-0 rows up to the chunk's last anchor plus
the chunk's mask rows, with a dense mask (SDPA), capped at ``max_elements`` rows per forward.

Shape letters: T positions, A aux layers, H hidden, K depths, C anchors in a chunk, N flat elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.model.mask import dense_mask, dense_peagle_mask
from peagle.model.sequential import unroll
from peagle.pipeline.progress import track
from peagle.pipeline.store_reader import TrainingSample
from peagle.stages.eval.acceptance import AcceptanceHistogram


@dataclass
class OfflineResult:
    """Teacher-forced acceptance over many chains."""

    histogram: AcceptanceHistogram
    agreement_at_depth: list[int] = field(default_factory=list)  # draft d == argmax, ignoring earlier depths
    num_samples: int = 0
    num_tokens: int = 0

    def to_dict(self) -> dict:
        n = self.histogram.num_steps
        return {
            **self.histogram.to_dict(),
            "num_chains": n,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "top1_agreement_at_depth": [c / n if n else float("nan") for c in self.agreement_at_depth],
        }


def chain_anchors(supervised_T: Tensor, num_depths: int) -> Tensor:
    """Anchors p whose positions p .. p+K−1 are all supervised (ascending)."""
    T = supervised_T.numel()
    if T < num_depths:
        return torch.empty(0, dtype=torch.long)
    run_T1 = torch.cat([torch.zeros(1, dtype=torch.long), supervised_T.long().cumsum(0)])
    full = (run_T1[num_depths:] - run_T1[:-num_depths]) == num_depths
    return full.nonzero().flatten()


@torch.no_grad()
def chain_correct(draft: PEagleDraft, sample: TrainingSample, num_depths: int, *,
                  max_elements: int = 4096) -> Tensor:
    """``[K, C]`` bool: draft j+1 of anchor c equals the target's argmax, for every full-chain anchor."""
    K = num_depths
    T = sample.num_positions
    rows_T = sample.topk_logprobs_Tk.float().argmax(dim=-1)
    target_T = sample.topk_ids_Tk.long().gather(1, rows_T[:, None]).flatten()
    anchors = chain_anchors(sample.supervised_T, K)
    out = []
    start = 0
    while start < anchors.numel():
        end = start + 1  # grow the chunk while the forward stays under max_elements rows
        while end < anchors.numel() and int(anchors[end]) + 1 + (K - 1) * (end + 1 - start) <= max_elements:
            end += 1
        out.append(_chunk_correct(draft, sample.tokens_T, sample.aux_TAH, target_T, anchors[start:end], K, T))
        start = end
    return torch.cat(out, dim=1) if out else torch.empty(K, 0, dtype=torch.bool)


def _chunk_correct(draft: PEagleDraft, tokens_T: Tensor, aux_TAH: Tensor, target_T: Tensor, anchors_C: Tensor,
                   K: int, T: int) -> Tensor:
    num_real = int(anchors_C[-1]) + 1
    C = anchors_C.numel()
    depth_K1 = torch.arange(1, K)
    anchor_N = torch.cat([torch.arange(num_real), anchors_C.repeat(K - 1)])
    depth_N = torch.cat([torch.zeros(num_real, dtype=torch.long), depth_K1.repeat_interleave(C)])
    if draft.config.method == "eagle3":
        # Depth d >= 1 reads the target's greedy token at its parent's reference position: what a chain
        # still alive under greedy verification feeds (its drafts so far equal those tokens).
        tokens_N = torch.cat([tokens_T[:num_real], target_T[anchor_N[num_real:] + depth_N[num_real:] - 1]])
        doc_N = torch.zeros_like(anchor_N)
        depth_starts = (0, *(num_real + C * torch.arange(K)).tolist())
        masks = [dense_mask(anchor_N, depth_N, doc_N, slice(a, b)) for a, b in zip(depth_starts, depth_starts[1:])]
        hidden_NH = unroll(draft, tokens_N, aux_TAH[:num_real], anchor_N + depth_N, anchor_N, depth_starts, masks)
    else:
        mask_NN = dense_peagle_mask(anchor_N, depth_N, torch.tensor([T]), T)
        hidden_NH = draft(tokens_T[:num_real], aux_TAH[:num_real], anchor_N + depth_N, mask_NN)
    rows = torch.cat([anchors_C, num_real + torch.arange((K - 1) * C)])  # depth 0 at the anchors, then deeper rows
    draft_ids = draft.compute_logits(hidden_NH[rows]).argmax(dim=-1)
    proposed_KC = draft.draft_to_target(draft_ids).view(K, C)
    return proposed_KC == target_T[anchors_C[None, :] + torch.arange(K)[:, None]]


def evaluate_offline(draft: PEagleDraft, samples: Iterable[TrainingSample], num_depths: int, *,
                     max_elements: int = 4096, progress: bool = False) -> OfflineResult:
    """Teacher-forced acceptance over ``samples`` (module docstring)."""
    result = OfflineResult(histogram=AcceptanceHistogram(num_depths), agreement_at_depth=[0] * num_depths)
    for sample in track(samples, desc="offline chains", unit="sample", enabled=progress):
        correct_KC = chain_correct(draft, sample, num_depths, max_elements=max_elements)
        accepted_C = correct_KC.long().cumprod(dim=0).sum(dim=0)
        for a, count in zip(*torch.unique(accepted_C, return_counts=True)):
            result.histogram.add(int(a), int(count))
        result.agreement_at_depth = [x + int(c) for x, c in zip(result.agreement_at_depth, correct_KC.sum(dim=1))]
        result.num_samples += 1
        result.num_tokens += sample.num_positions + 1
    return result
