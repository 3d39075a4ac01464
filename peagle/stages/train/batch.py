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

**The aux states are read once, straight into pinned memory.** ``aux_TAH`` is ~97% of a batch's
bytes (24 KiB/token for an 8B target: 200 MB at L = 8192). A DataLoader worker that copies it
pays for fresh memory page by page, then ships it through shared memory, where the trainer process
faults it in again before copying it into pinned memory: three passes over 200 MB
(benchmarks/loader_throughput.py). So workers build everything *but* the aux rows and hand over an
``AuxSource`` (the store reader's: file, offset, length per sample); ``TrainBatch.pin_memory()``
-- run by the DataLoader's pin thread in the trainer process, concurrently with the step -- reads
the rows with ``preadv`` directly into a (cached) pinned buffer, one pass. ``TrainBatch.materialize()`` does the
same into ordinary memory (CPU training; ``to()`` calls it when needed).

**An fp8 store's rows stay fp8 until the device** (:mod:`peagle.pipeline.fp8`). The batch then
carries the codes in ``aux_TAH`` (``float8_e4m3fn``) and a float32 scale per (row, layer) in
``aux_scale_TA``: half the bytes of bf16 from disk, into pinned memory and over the host-to-device
copy. The step dequantises on the device (``aux_states``), just before the draft's ``fc``. For CPU
training the loader's workers dequantise instead (``dequantized``): there is no copy to save.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from peagle.model.mask import document_ids
from peagle.pipeline.store_reader import AuxSource, ByteRange, StoredAux, TrainingSample
from peagle.schemas.loader_config import CodSettings
from peagle.stages.train.cod import pack_cod
from peagle.stages.train.methods import PEAGLE, TrainingMethod
from peagle.stages.train.segments import UnitPlan, plan_units


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


@dataclass(kw_only=True)
class TrainBatch:
    """One micro-batch: D samples packed into one flat row (module docstring), ready for the draft.

    Row of T training positions (samples back to back; ``doc_starts_D``/``doc_lengths_D`` locate them):
        tokens_T        int64 [T]      x_{p+1} of every position: the depth-0 input tokens
        aux_TAH         bf16 [T, A, H] aux[p]: the depth-0 input states; None until read (aux_source);
                        float8_e4m3fn codes when ``aux_scale_TA`` is set (``aux_states`` decodes)
        aux_scale_TA    fp32 [T, A]    fp8 batches: the scale of each (row, layer); else None
        supervised_T    bool [T]       the shifted mask m[p]
        doc_starts_D, doc_lengths_D    int64 [D]

    Flat COD sequence of N elements, grouped by depth, row anchors ascending inside a depth. Its
    first T elements are the depth-0 group, i.e. positions 0..T−1 in order, matching ``aux_TAH``
    row for row (the draft's "real rows first" input):
        anchor_N        int64 [N]      row offset where the element's chain starts
        depth_N         int64 [N]
        position_ids_N  int64 [N]      RoPE position: anchor + depth, counted from the sample's start
        doc_N           int64 [N]      the sample (document) each element belongs to

    Supervision, for the E supervised elements that have a target:
        supervised_idx_E   int64 [E]     indices into the flat sequence, ascending
        target_ids_Ek      int64 [E, k]  the target's top-k as draft ids (−1: not in the draft vocab)
        target_probs_Ek    fp32 [E, k]   renormalised over the in-vocab ids (0 at −1 ids)
        depth_E            int64 [E]     depth of each supervised element (per-depth metrics)

    Chains, for the exact acceptance-length metric (:func:`chain_targets`):
        chain_target_idx_CK  int64 [C, K]  the target (index into E) of chain c's depth-d element,
                                           E where that element has none (it rejects)

    Counts: ``num_tokens`` = T, ``num_supervised`` = E, ``num_no_target`` = supervised elements
    dropped because no top-k id is in the draft vocab; ``num_elements`` = N.

    ``aux_source`` says where the aux rows are while ``aux_TAH`` is None (module docstring);
    ``pin_memory()``, ``materialize()`` and ``to()`` read them.

    ``units``: the row's forward+backward units (``segments.plan_units``: the whole row for S = 1,
    one per segment otherwise), with their BlockMask indices under flex attention. Workers plan
    them, so the trainer only gathers with them on the device and wraps the indices
    (``peagle.model.mask.block_mask_from_indices``): a step never reads anything back to the host.
    """

    tokens_T: Tensor
    aux_TAH: Tensor | None
    supervised_T: Tensor
    doc_starts_D: Tensor
    doc_lengths_D: Tensor
    anchor_N: Tensor
    depth_N: Tensor
    position_ids_N: Tensor
    supervised_idx_E: Tensor
    target_ids_Ek: Tensor
    target_probs_Ek: Tensor
    depth_E: Tensor
    chain_target_idx_CK: Tensor
    num_tokens: int
    num_supervised: int
    num_no_target: int
    sample_ids: tuple[str, ...]
    doc_N: Tensor
    units: list[UnitPlan]
    aux_source: AuxSource | None = None
    epoch: int = 0
    batch_index: int = 0
    aux_scale_TA: Tensor | None = None

    @property
    def num_elements(self) -> int:
        return int(self.anchor_N.numel())

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    def aux_states(self, rows: Tensor | None = None) -> Tensor:
        """The depth-0 input states ``aux_TAH[rows]`` (all rows for None) in bf16, dequantised here, on
        the batch's device, for an fp8 batch."""
        assert self.aux_TAH is not None, "read the aux rows first (materialize)"
        stored = StoredAux(self.aux_TAH, self.aux_scale_TA)
        return (stored if rows is None else stored[rows]).states()

    def dequantized(self) -> "TrainBatch":
        """The batch with bf16 ``aux_TAH`` (read first if needed); self if it holds bf16 states already."""
        batch = self.materialize()
        if batch.aux_scale_TA is None:
            return batch
        return dataclasses.replace(batch, aux_TAH=batch.aux_states(), aux_scale_TA=None)

    def materialize(self, *, pin: bool = False) -> "TrainBatch":
        """The batch with its aux rows read from disk as stored (into pinned memory with ``pin``); self
        if they are."""
        if self.aux_TAH is not None:
            return self
        src = self.aux_source
        assert src is not None, "a batch without aux_TAH must carry its aux_source"
        stored = src.read(pin=pin)
        return dataclasses.replace(self, aux_TAH=stored.values_TAH, aux_scale_TA=stored.scale_TA, aux_source=None)

    def pin_memory(self) -> "TrainBatch":
        """Page-locked copy (the DataLoader's pin thread calls this), so ``to(cuda, non_blocking)`` overlaps.

        Unread aux rows (and scales) go from the file straight into pinned memory (module docstring).
        """
        fresh = self.aux_TAH is None
        batch = self.materialize(pin=True)
        read = (batch.aux_TAH, batch.aux_scale_TA) if fresh else ()
        return _map_tensors(batch, lambda t: t if any(t is r for r in read) else t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TrainBatch":
        return _map_tensors(self.materialize(), lambda t: t.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: Any) -> None:
        """Mark every tensor as used on ``stream`` (a batch copied on a side stream, read on another)."""
        _map_tensors(self, lambda t: (t.record_stream(stream), t)[1])


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply ``fn`` to every tensor inside dataclasses, NamedTuples, lists and tuples."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


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
