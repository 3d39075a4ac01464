"""The packed batch the trainer steps on: one flat row of samples, its elements, targets and units.

Shape letters: T = training positions (summed over the samples of a batch); A = aux layers; H =
hidden size; k = stored top-k; D = samples (documents) in the batch; N = flat COD elements; E =
supervised flat elements that have a target; C = complete chains; K = depths.

A module of its own so that data flows one way: the loader's batch builder (``batch.py``) asks the
training methods (``methods/``) for each sample's elements, and the methods read batches; both
import this module, and it imports neither. How a batch is packed is ``batch.py``'s docstring.

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

from peagle.pipeline.store_reader import AuxSource, StoredAux
from peagle.stages.train.segments import UnitPlan


@dataclass(kw_only=True)
class TrainBatch:
    """One micro-batch: D samples packed into one flat row (``batch.py``'s docstring), ready for the draft.

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

    ``sources``: per sample, (store root, shard index) it was read from (the loader's; empty for a
    batch collated by hand): what a non-finite step names (``bad_steps.py``).

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
    sources: tuple[tuple[str, int], ...] = ()

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


__all__ = ["TrainBatch"]
