"""What the loader hands the trainer: one sample in training coordinates, and one packed batch.

Shape letters: n = a sample's tokens; T = training positions (n − 1 per sample, summed over the
samples of a batch); A = aux layers; H = hidden size; k = stored top-k; D = samples (documents) in
the batch; N = flat COD elements; E = supervised flat elements that have a target.

**Training coordinates (docs/indexing.md).** Samples arrive from the store reader
(:mod:`peagle.pipeline.store_reader`, where the index shift is done, once) as per-position arrays:
for p ∈ [0, n−2] the depth-0 element at p reads ``x_{p+1}`` and ``aux[p]``; any element whose
reference position (``anchor + depth``) is p predicts ``x_{p+2}``, with target distribution
``topk[p+1]``, and is supervised iff ``m[p] = 1``. :func:`make_item` adds the training method's draw of
elements (``methods/``: COD sampling, or every chain); nothing here adds 1 or 2 to an index.

**One flat row per batch, no padding.** A batch packs several samples, back to back, into one row
of T positions under a token budget. A unit's forward is over the flat COD sequence, whose length
N is random (COD sampling) even for one sample, so a "row per sample" layout would pad every row to
the longest N of the batch; packing into one row pads nothing. Documents stay isolated through the
mask (``doc_lengths_D``: an element sees only elements of its own sample, docs/mask.md), COD sampling
stays per sample, and RoPE positions count from each sample's start (``position_ids_N``), so a packed
sample is computed exactly as it would be alone.

**Only supervised elements carry targets (docs/performance.md).** Targets are gathered for the E elements with
``m[ref] = 1`` whose top-k holds at least one draft-vocab id, as draft ids (−1 for top-k ids outside
the draft vocab, column order kept, so column 0 is the target's argmax) and probabilities
renormalised over the in-vocab ids. Supervised elements whose top-k has no draft-vocab id are
dropped and counted in ``num_no_target``.

**The batch type** (``TrainBatch``: its layout, how its aux rows are read once, straight into
pinned memory, and how an fp8 store's rows stay fp8 until the device) is :mod:`.train_batch`,
which the training methods import too; this module builds batches and imports the methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from peagle.model.mask import document_ids
from peagle.pipeline.store_reader import AuxSource, ByteRange, StoredAux, TrainingSample
from peagle.schemas.cod_settings import CodSettings
from peagle.stages.train.cod import pack_cod
from peagle.stages.train.methods import PEAGLE, TrainingMethod
from peagle.stages.train.segments import plan_units
from peagle.stages.train.train_batch import TrainBatch


@dataclass(frozen=True, kw_only=True)
class TrainItem:
    """One sample in training coordinates (a ``TrainingSample``'s arrays) with its elements (the training
    method's draw: COD sampling for P-EAGLE, every chain for EAGLE-3).

    ``aux``, ``topk_*_Tk`` may be views into a memory-mapped shard: nothing is copied until
    :func:`collate` writes the batch.
    """

    sample_id: str
    tokens_T: Tensor  # int64, x_{p+1}: the depth-0 input token at p
    aux: StoredAux  # aux[p], as stored (bf16, or fp8 codes + scales)
    supervised_T: Tensor  # bool, m[p] = loss_mask[p+2]; m[T-1] = False
    topk_ids_Tk: Tensor  # int32, topk[p+1] (the distribution of x_{p+2})
    topk_logprobs_Tk: Tensor  # float16/32, topk[p+1]
    anchor_pos: Tensor  # int64 [n_cod], the elements' anchors in sample coordinates (flat COD layout)
    depth: Tensor  # int64 [n_cod]
    num_depths: int  # K of the draw: a chain is complete when it reaches depth K − 1

    @property
    def num_positions(self) -> int:
        return int(self.tokens_T.numel())


def make_item(sample: TrainingSample, *, cod: CodSettings, seed: int, epoch: int,
              method: TrainingMethod = PEAGLE) -> TrainItem:
    """One sample's elements as the training method draws them (the sample comes from the store reader,
    already shifted).

    P-EAGLE's COD draw uses ``cod_generator(seed, epoch, sample_id)`` only, so the item depends on
    (seed, epoch, sample_id) and the store contents, never on rank, worker or resume point.
    """
    assert sample.num_positions >= 1, "a sample needs two tokens"
    anchor_pos, depth = method.draw(sample, cod, seed=seed, epoch=epoch)
    return TrainItem(
        sample_id=sample.sample_id,
        tokens_T=sample.tokens_T,
        aux=sample.aux,
        supervised_T=sample.supervised_T,
        topk_ids_Tk=sample.topk_ids_Tk,
        topk_logprobs_Tk=sample.topk_logprobs_Tk,
        anchor_pos=anchor_pos,
        depth=depth,
        num_depths=cod.num_depths,
    )


def collate(items: list[TrainItem], *, target_to_draft_V: Tensor, num_segments: int = 1,
            block_size: int | None = None, epoch: int = 0, batch_index: int = 0,
            aux_reads: list[tuple[ByteRange, ByteRange | None]] | None = None,
            method: TrainingMethod = PEAGLE) -> TrainBatch:
    """Pack items into one flat row and gather the supervised targets (module docstring).

    Args:
        target_to_draft_V: int64 ``[V]``, the draft id of each target id (−1 outside the draft vocab).
        num_segments: S; > 1 plans one unit per segment.
        block_size: flex attention block size; None (sdpa) computes no block indices, else the
            training ``method`` plans them for each unit (one mask, or one per depth).
        aux_reads: per item, where its aux rows (and fp8 scales, else None) are on disk
            (``ShardReader.aux_read``): the batch then carries an ``AuxSource`` instead of copying
            ``item.aux`` (DataLoader workers).
    """
    assert items, "collate needs at least one item"
    num_depths = items[0].num_depths
    assert all(it.num_depths == num_depths for it in items), "one batch, one COD depth count"
    lengths = [it.num_positions for it in items]
    doc_lengths_D = torch.tensor(lengths, dtype=torch.long)
    doc_starts_D = torch.cumsum(doc_lengths_D, 0) - doc_lengths_D
    num_tokens = int(doc_lengths_D.sum())
    tokens_T = torch.cat([it.tokens_T for it in items])
    aux_TAH, aux_scale_TA, aux_source = None, None, None
    fp8_rows = items[0].aux.scale_TA is not None
    assert all((it.aux.scale_TA is not None) == fp8_rows for it in items), "one batch, one aux encoding"
    if aux_reads is None:
        aux_TAH = torch.cat([it.aux.values_TAH for it in items])
        aux_scale_TA = torch.cat([it.aux.scale_TA for it in items]) if fp8_rows else None
    else:
        assert len(aux_reads) == len(items), "one aux read per item"
        first = items[0].aux.values_TAH
        aux_source = AuxSource((num_tokens, *first.shape[1:]), first.dtype, tuple(r for r, _ in aux_reads),
                               tuple(s for _, s in aux_reads) if fp8_rows else None)
    supervised_T = torch.cat([it.supervised_T for it in items])

    anchor_N, depth_N, position_ids_N = pack_cod([(it.anchor_pos, it.depth) for it in items], doc_starts_D.tolist())
    num_elements = anchor_N.numel()
    assert bool((depth_N[:num_tokens] == 0).all()) and bool(
        (anchor_N[:num_tokens] == torch.arange(num_tokens)).all()), "depth-0 group is not positions 0..T-1"

    # Targets: only at supervised elements (reference position anchor + depth with m = 1).
    ref_N = anchor_N + depth_N
    candidate_C = torch.nonzero(supervised_T[ref_N]).flatten()
    ref_C = ref_N[candidate_C]
    topk_ids_Ck = torch.cat([it.topk_ids_Tk for it in items])[ref_C].long()
    logprobs_Ck = torch.cat([it.topk_logprobs_Tk for it in items])[ref_C].float()
    draft_ids_Ck = target_to_draft_V[topk_ids_Ck]
    probs_Ck = torch.where(draft_ids_Ck >= 0, logprobs_Ck.exp(), torch.zeros_like(logprobs_Ck))
    mass_C = probs_Ck.sum(dim=-1)
    has_target_C = mass_C > 0
    keep = torch.nonzero(has_target_C).flatten()
    supervised_idx_E = candidate_C[keep]

    return TrainBatch(
        tokens_T=tokens_T, aux_TAH=aux_TAH, supervised_T=supervised_T,
        doc_starts_D=doc_starts_D, doc_lengths_D=doc_lengths_D,
        anchor_N=anchor_N, depth_N=depth_N, position_ids_N=position_ids_N,
        supervised_idx_E=supervised_idx_E, target_ids_Ek=draft_ids_Ck[keep],
        target_probs_Ek=probs_Ck[keep] / mass_C[keep, None], depth_E=depth_N[supervised_idx_E],
        chain_target_idx_CK=chain_targets(anchor_N, depth_N, supervised_T, supervised_idx_E, num_depths),
        num_tokens=num_tokens, num_supervised=int(keep.numel()),
        num_no_target=int(candidate_C.numel() - keep.numel()),
        sample_ids=tuple(it.sample_id for it in items), doc_N=document_ids(anchor_N, doc_lengths_D, num_tokens),
        units=plan_units(anchor_N, depth_N, doc_starts_D, doc_lengths_D, supervised_idx_E, num_segments,
                         num_depths=num_depths, block_size=block_size, block_indices_fn=method.block_indices),
        aux_source=aux_source, epoch=epoch, batch_index=batch_index, aux_scale_TA=aux_scale_TA,
    )


def chain_targets(anchor_N: Tensor, depth_N: Tensor, supervised_T: Tensor, supervised_idx_E: Tensor,
                  num_depths: int) -> Tensor:
    """``[C, K]``: for each complete chain of the row, the target (index into E) of its depth-d element.

    The chains are those the offline evaluator reads (``peagle.stages.eval.offline.chain_anchors``):
    anchors a whose K positions a … a+K−1 are all supervised. The COD draw keeps a random subset of
    them: a has a depth-(K−1) element (its depth 1 … K−1 elements are supervised by construction,
    and present because COD chains are complete, docs/cod.md) and its depth-0 element is supervised
    (``m[a]``; depth 0 is drawn everywhere, supervised or not). Shorter chains are left out: a chain
    COD stopped at depth d < K−1 says nothing of its deeper drafts, and averaging it in as if it
    were rejected there would bias the estimate low. A chain element that is supervised but has no
    target (no top-k id in the draft vocab: ``num_no_target``) gets index E, a rejection.

    Computed here, in the loader worker, so the step only gathers (docs/performance.md).
    """
    K = num_depths
    num_tokens = supervised_T.numel()
    anchors_C = anchor_N[depth_N == K - 1]
    anchors_C = anchors_C[supervised_T[anchors_C]]
    # The flat layout is sorted by (depth, row anchor) without duplicates: one searchsorted finds (a, d).
    key_N = depth_N * num_tokens + anchor_N
    want_CK = torch.arange(K) * num_tokens + anchors_C[:, None]
    flat_CK = torch.searchsorted(key_N, want_CK).clamp(max=max(key_N.numel() - 1, 0))
    assert bool((key_N[flat_CK] == want_CK).all()), "a COD chain is incomplete"
    E = supervised_idx_E.numel()
    pos_CK = torch.searchsorted(supervised_idx_E, flat_CK)  # in [0, E]; E reads the −1 below
    has_target_CK = torch.cat([supervised_idx_E, supervised_idx_E.new_full((1,), -1)])[pos_CK] == flat_CK
    return torch.where(has_target_CK, pos_CK, torch.full_like(pos_CK, E))

__all__ = ["TrainItem", "TrainBatch", "make_item", "collate", "chain_targets"]
