"""What the loader hands the trainer: one sample in training coordinates, and one packed batch.

Shape letters: n = a sample's tokens; T = training positions (n − 1 per sample, summed over the
samples of a batch); A = aux layers; H = hidden size; k = stored top-k; D = samples (documents) in
the batch; N = flat COD elements; E = supervised flat elements that have a target.

**Index shifting (DESIGN §3), done once, here.** For a sample ``x_0 … x_{n−1}`` the training
positions are p ∈ [0, n−2]. The depth-0 element at p reads ``x_{p+1}`` and ``aux[p]``; any element
whose reference position (``anchor + depth``) is p predicts ``x_{p+2}``, with target distribution
``topk[p+1]``, and is supervised iff ``m[p] = loss_mask[p+2]`` (``m[n−2] = 0``: no ``x_n``).
:func:`make_item` slices the raw store rows into exactly these per-position arrays, so nothing
downstream ever adds 1 or 2 again.

**One flat row per batch, no padding.** A batch packs several samples, back to back, into one row
of T positions under a token budget. The P-EAGLE forward is over the flat COD sequence, whose length
N is random (COD sampling) even for one sample, so a "row per sample" layout would pad every row to
the longest N of the batch; packing into one row pads nothing. Documents stay isolated through the
mask (``doc_lengths_D``: an element sees only elements of its own sample, DESIGN §4), COD sampling
stays per sample, and RoPE positions count from each sample's start (``position_ids_N``), so a packed
sample is computed exactly as it would be alone.

**Only supervised elements carry targets (DESIGN §8).** Targets are gathered for the E elements with
``m[ref] = 1`` whose top-k holds at least one draft-vocab id, as draft ids (−1 for top-k ids outside
the draft vocab, column order kept, so column 0 is the target's argmax) and probabilities
renormalised over the in-vocab ids. Supervised elements whose top-k has no draft-vocab id are
dropped and counted in ``num_no_target``.

**The aux states are read once, straight into pinned memory.** ``aux_TAH`` is ~97% of a batch's
bytes (24 KiB/token for an 8B target: 200 MB at L = 8192). A DataLoader worker that copies it
pays for fresh memory page by page, then ships it through shared memory, where the trainer process
faults it in again before copying it into pinned memory: three passes over 200 MB
(benchmarks/loader_throughput.py). So workers build everything *but* the aux rows and hand over an
:class:`AuxSource` (file, offset, length per sample); ``TrainBatch.pin_memory()`` -- run by the
DataLoader's pin thread in the trainer process, concurrently with the step -- reads the rows with
``preadv`` directly into a (cached) pinned buffer, one pass. ``TrainBatch.materialize()`` does the
same into ordinary memory (CPU training; ``to()`` calls it when needed).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from peagle.model.mask import DEFAULT_BLOCK_SIZE, document_ids
from peagle.stages.train.cod import cod_generator, generate_cod_sample_indices, pack_cod
from peagle.stages.train.segments import UnitPlan, plan_units


@dataclass(frozen=True, kw_only=True)
class CodSettings:
    """How COD sampling draws a sample's elements (DESIGN §4)."""

    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: int | None = None


@dataclass(frozen=True)
class AuxSource:
    """Where a batch's ``aux_TAH`` rows lie on disk: one contiguous byte range per sample, in row order."""

    shape: tuple[int, ...]  # (T, A, H)
    dtype: torch.dtype
    reads: tuple[tuple[str, int, int], ...]  # (safetensors path, byte offset, byte count)

    def read_into(self, out_TAH: Tensor) -> Tensor:
        """Fill ``out_TAH`` (contiguous, CPU) with the rows; the GIL is released while the kernel copies."""
        assert tuple(out_TAH.shape) == tuple(self.shape) and out_TAH.dtype == self.dtype and out_TAH.is_contiguous()
        buffer = memoryview(out_TAH.view(-1).view(torch.uint8).numpy())
        pos = 0
        for path, offset, nbytes in self.reads:
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < nbytes:
                    got = os.preadv(fd, [buffer[pos + done:pos + nbytes]], offset + done)
                    if got <= 0:
                        raise OSError(f"{path}: file ended at byte {offset + done}, expected {offset + nbytes}")
                    done += got
            finally:
                os.close(fd)
            pos += nbytes
        assert pos == buffer.nbytes, "aux reads do not cover the batch"
        return out_TAH


@dataclass(frozen=True, kw_only=True)
class TrainItem:
    """One sample in training coordinates: T = n − 1 positions p, all arrays indexed by p.

    ``aux_TAH``, ``topk_*_Tk`` may be views into a memory-mapped shard: nothing is copied until
    :func:`collate` writes the batch.
    """

    sample_id: str
    tokens_T: Tensor  # int64, x_{p+1}: the depth-0 input token at p
    aux_TAH: Tensor  # bfloat16, aux[p]
    supervised_T: Tensor  # bool, m[p] = loss_mask[p+2]; m[T-1] = False
    topk_ids_Tk: Tensor  # int32, topk[p+1] (the distribution of x_{p+2})
    topk_logprobs_Tk: Tensor  # float16/32, topk[p+1]
    anchor_pos: Tensor  # int64 [n_cod], COD draw in sample coordinates (flat COD layout)
    depth: Tensor  # int64 [n_cod]

    @property
    def num_positions(self) -> int:
        return int(self.tokens_T.numel())


def make_item(sample_id: str, input_ids_n: Tensor, loss_mask_n: Tensor, aux_nAH: Tensor, topk_ids_nk: Tensor,
              topk_logprobs_nk: Tensor, *, cod: CodSettings, seed: int, epoch: int) -> TrainItem:
    """Shift one sample's raw store rows into training coordinates and draw its COD elements.

    The COD draw uses ``cod_generator(seed, epoch, sample_id)`` only, so the item depends on
    (seed, epoch, sample_id) and the store contents, never on rank, worker or resume point.
    """
    n = int(input_ids_n.numel())
    assert n >= 2 and aux_nAH.shape[0] == n and topk_ids_nk.shape[0] == n, "sample rows disagree"
    num_positions = n - 1
    supervised_T = torch.zeros(num_positions, dtype=torch.bool)
    supervised_T[: num_positions - 1] = torch.as_tensor(loss_mask_n)[2:].to(torch.bool)
    anchor_pos, depth = generate_cod_sample_indices(
        num_positions, supervised_T, cod.num_depths, cod.down_sample_ratio, cod.down_sample_ratio_min,
        True, generator=cod_generator(seed, epoch, sample_id), max_anchors=cod.max_anchors)
    return TrainItem(
        sample_id=sample_id,
        tokens_T=torch.as_tensor(input_ids_n)[1:].to(torch.long),
        aux_TAH=aux_nAH[:num_positions],
        supervised_T=supervised_T,
        topk_ids_Tk=topk_ids_nk[1:],
        topk_logprobs_Tk=topk_logprobs_nk[1:],
        anchor_pos=anchor_pos,
        depth=depth,
    )


@dataclass(kw_only=True)
class TrainBatch:
    """One micro-batch: D samples packed into one flat row (module docstring), ready for the draft.

    Row of T training positions (samples back to back; ``doc_starts_D``/``doc_lengths_D`` locate them):
        tokens_T        int64 [T]      x_{p+1} of every position: the depth-0 input tokens
        aux_TAH         bf16 [T, A, H] aux[p]: the depth-0 input states; None until read (aux_source)
        supervised_T    bool [T]       the shifted mask m[p]
        doc_starts_D, doc_lengths_D    int64 [D]

    Flat COD sequence of N elements, grouped by depth, row anchors ascending inside a depth. Its
    first T elements are the depth-0 group, i.e. positions 0..T−1 in order, matching ``aux_TAH``
    row for row (the draft's "real rows first" input):
        anchor_N        int64 [N]      row offset where the element's chain starts
        depth_N         int64 [N]
        position_ids_N  int64 [N]      RoPE position: anchor + depth, counted from the sample's start
        input_ids_N     int64 [N]      tokens_T for depth 0, ``mask_token_id`` for depth >= 1
        doc_N           int64 [N]      the sample (document) each element belongs to

    Supervision, for the E supervised elements that have a target:
        supervised_idx_E   int64 [E]     indices into the flat sequence, ascending
        target_ids_Ek      int64 [E, k]  the target's top-k as draft ids (−1: not in the draft vocab)
        target_probs_Ek    fp32 [E, k]   renormalised over the in-vocab ids (0 at −1 ids)
        depth_E            int64 [E]     depth of each supervised element (per-depth metrics)

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
    input_ids_N: Tensor
    supervised_idx_E: Tensor
    target_ids_Ek: Tensor
    target_probs_Ek: Tensor
    depth_E: Tensor
    num_tokens: int
    num_supervised: int
    num_no_target: int
    sample_ids: tuple[str, ...]
    doc_N: Tensor
    units: list[UnitPlan]
    aux_source: AuxSource | None = None
    epoch: int = 0
    batch_index: int = 0

    @property
    def num_elements(self) -> int:
        return int(self.anchor_N.numel())

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    def materialize(self, *, pin: bool = False) -> "TrainBatch":
        """The batch with ``aux_TAH`` read from disk (into pinned memory with ``pin``); self if it is."""
        if self.aux_TAH is not None:
            return self
        src = self.aux_source
        assert src is not None, "a batch without aux_TAH must carry its aux_source"
        out_TAH = src.read_into(torch.empty(src.shape, dtype=src.dtype, pin_memory=pin))
        return dataclasses.replace(self, aux_TAH=out_TAH, aux_source=None)

    def pin_memory(self) -> "TrainBatch":
        """Page-locked copy (the DataLoader's pin thread calls this), so ``to(cuda, non_blocking)`` overlaps.

        Unread aux rows go from the file straight into pinned memory (module docstring).
        """
        fresh = self.aux_TAH is None
        batch = self.materialize(pin=True)
        return _map_tensors(batch, lambda t: t if (fresh and t is batch.aux_TAH) else t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TrainBatch":
        return _map_tensors(self.materialize(), lambda t: t.to(device, non_blocking=non_blocking))


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


def collate(items: list[TrainItem], *, target_to_draft_V: Tensor, mask_token_id: int, num_segments: int = 1,
            block_size: int | None = None, epoch: int = 0, batch_index: int = 0,
            aux_reads: list[tuple[str, int, int]] | None = None) -> TrainBatch:
    """Pack items into one flat row and gather the supervised targets (module docstring).

    Args:
        target_to_draft_V: int64 ``[V]``, the draft id of each target id (−1 outside the draft vocab).
        mask_token_id: input token of every depth >= 1 element.
        num_segments: S; > 1 plans one unit per segment.
        block_size: flex attention block size; None (sdpa) computes no block indices.
        aux_reads: per item, (safetensors path, byte offset, byte count) of its aux rows: the batch then
            carries an :class:`AuxSource` instead of copying ``item.aux_TAH`` (DataLoader workers).
    """
    assert items, "collate needs at least one item"
    lengths = [it.num_positions for it in items]
    doc_lengths_D = torch.tensor(lengths, dtype=torch.long)
    doc_starts_D = torch.cumsum(doc_lengths_D, 0) - doc_lengths_D
    num_tokens = int(doc_lengths_D.sum())
    tokens_T = torch.cat([it.tokens_T for it in items])
    first = items[0].aux_TAH
    aux_TAH, aux_source = None, None
    if aux_reads is None:
        aux_TAH = torch.cat([it.aux_TAH for it in items])
    else:
        assert len(aux_reads) == len(items), "one aux read per item"
        aux_source = AuxSource((num_tokens, *first.shape[1:]), first.dtype, tuple(aux_reads))
    supervised_T = torch.cat([it.supervised_T for it in items])

    anchor_N, depth_N, position_ids_N = pack_cod([(it.anchor_pos, it.depth) for it in items], doc_starts_D.tolist())
    num_elements = anchor_N.numel()
    assert bool((depth_N[:num_tokens] == 0).all()) and bool(
        (anchor_N[:num_tokens] == torch.arange(num_tokens)).all()), "depth-0 group is not positions 0..T-1"
    input_ids_N = torch.cat([tokens_T, torch.full((num_elements - num_tokens,), mask_token_id, dtype=torch.long)])

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
        anchor_N=anchor_N, depth_N=depth_N, position_ids_N=position_ids_N, input_ids_N=input_ids_N,
        supervised_idx_E=supervised_idx_E, target_ids_Ek=draft_ids_Ck[keep],
        target_probs_Ek=probs_Ck[keep] / mass_C[keep, None], depth_E=depth_N[supervised_idx_E],
        num_tokens=num_tokens, num_supervised=int(keep.numel()),
        num_no_target=int(candidate_C.numel() - keep.numel()),
        sample_ids=tuple(it.sample_id for it in items), doc_N=document_ids(anchor_N, doc_lengths_D, num_tokens),
        units=plan_units(anchor_N, depth_N, doc_starts_D, doc_lengths_D, supervised_idx_E, num_segments,
                         block_size=block_size),
        aux_source=aux_source, epoch=epoch, batch_index=batch_index,
    )


__all__ = ["AuxSource", "CodSettings", "TrainItem", "TrainBatch", "make_item", "collate", "DEFAULT_BLOCK_SIZE"]
