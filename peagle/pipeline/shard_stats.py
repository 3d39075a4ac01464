"""Content statistics of stored rows: per sample (:func:`sample_rows`) and per shard (:func:`shard_stats`).

Extract's writer computes a shard's statistics while it still holds the tensors, from exactly what it
writes (fp8: the dequantised codes), and puts them in the commit record; ``peagle store check``
computes the same numbers by reading a shard back (records written before statistics existed, and
its own per-row judgements); ``peagle train`` refuses a store whose records show all-zero or
non-finite rows. Inference engines have shipped bugs that dump exactly such rows for some requests
(chunked prefill, prefix caching, tensor parallelism), and a draft trained on them fails only when
served.

Rows here are the store's own (raw) rows, as the raw reader gives them (``RawSample``,
:mod:`peagle.pipeline.raw_reader`): row i of a sample of n tokens is ``aux[i]`` (the state after
x_0 … x_i) and ``topk[i]`` (the distribution of x_{i+1}, ``RawSample.next_tokens_n1``), i ∈ [0, n)
(docs/indexing.md).

Floats in a record are rounded to 6 significant digits: the record is part of the manifest, whose
bytes must not depend on summation order across machines (docs/reliability.md).

Shape letters: n rows of a sample, A aux layers, H hidden size, k stored top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from peagle.pipeline import fp8
from peagle.pipeline.aux_rows import StoredAux
from peagle.pipeline.raw_reader import RawSample
from peagle.schemas import store as S


@dataclass(frozen=True)
class SampleRows:
    """Row-level facts of one sample (numpy, so that a store check can keep many of them)."""

    norm_nA: np.ndarray  # float32 L2 norm of each (row, layer) state (NaN/inf where non-finite)
    zero_nA: np.ndarray  # bool: every value exactly 0
    non_finite_nA: np.ndarray  # bool: some value NaN or inf
    mass_n: np.ndarray  # float32 Σ exp(topk logprobs)
    topk_non_finite_n: np.ndarray  # bool
    agree_n1: np.ndarray  # bool [n − 1]: topk_ids[i, 0] == x_{i+1}
    in_topk_n1: np.ndarray  # bool [n − 1]: x_{i+1} is one of topk_ids[i]
    supervised_n1: np.ndarray  # bool [n − 1]: loss_mask[i+1], x_{i+1} is a token the draft learns

    @property
    def num_rows(self) -> int:
        return int(self.zero_nA.shape[0])

    def norm_rows_nA(self) -> np.ndarray:
        """Which (row, layer) norms enter the layer's norm distribution (``LayerStats``): finite, not
        all zero, and not the sample's first row (the attention sink's massive activations)."""
        usable = ~self.zero_nA & ~self.non_finite_nA
        usable[:1] = False
        return usable


NORM_CHUNK_ROWS = 4096  # states converted to float32 at a time where torch runs on several threads (48 MiB)


def state_norms(states_nAH: Tensor | StoredAux, chunk_rows: int | None = None) -> Tensor:
    """float32 L2 norm of each (row, layer) state, NaN/inf where a value is: the numbers of
    ``vector_norm(states.float(), dim=-1)``, computed through a float32 buffer of ``chunk_rows``
    (row, layer) states: by default ``fp8.chunk_rows()`` (256) on a thread that runs torch on one core,
    else ``NORM_CHUNK_ROWS``; fp8 ``StoredAux`` rows are dequantised into it chunk by chunk.

    Converting a shard's bf16 states whole allocates twice their size, and with the whole-tensor
    ``isfinite``/``== 0`` passes beside it this cost extract's writer 14 s per 0.6 GB shard of
    8B-shaped states on 2 CPU cores, more than the target's forward on a GPU
    (benchmarks/results/gpu/2026-11-27-h200-b/NOTES.md). On the writer's one torch thread a buffer
    that stays in the cache (256 rows, 4 MiB) makes the pass 5x faster again than one of 48 MiB, and
    dequantising an fp8 sample chunk by chunk instead of whole does more (benchmarks/writer_throughput.py).
    """
    aux = states_nAH if isinstance(states_nAH, StoredAux) else StoredAux(states_nAH)
    chunk_rows = chunk_rows or fp8.chunk_rows() or NORM_CHUNK_ROWS
    hidden = aux.values_TAH.shape[-1]
    flat_RH = aux.values_TAH.reshape(-1, hidden)
    scale_R = None if aux.scale_TA is None else aux.scale_TA.reshape(-1)
    if flat_RH.dtype == torch.float32:
        return torch.linalg.vector_norm(flat_RH, dim=-1).view(aux.values_TAH.shape[:-1])
    norms_R = torch.empty(flat_RH.shape[0], dtype=torch.float32)
    buffer_CH = torch.empty(min(chunk_rows, flat_RH.shape[0]), hidden, dtype=torch.float32)
    for start in range(0, flat_RH.shape[0], chunk_rows):
        rows = slice(start, min(start + chunk_rows, flat_RH.shape[0]))
        chunk_CH = buffer_CH[:rows.stop - start]
        chunk_CH.copy_(flat_RH[rows] if scale_R is None else fp8.dequantize(flat_RH[rows], scale_R[rows]))
        torch.linalg.vector_norm(chunk_CH, dim=-1, out=norms_R[rows])
    return norms_R.view(aux.values_TAH.shape[:-1])


def zero_and_non_finite(states_nAH: Tensor | StoredAux, norm_nA: Tensor) -> tuple[Tensor, Tensor]:
    """(every value exactly 0, some value NaN or inf) for each state, given its norm.

    Exact, and value by value only where the norm leaves doubt: a non-finite value makes the norm
    non-finite and an all-zero state makes it 0, but the squares of finite values can also overflow
    float32 (norm inf) or underflow it (norm 0), so those rare states are looked at whole (fp8 rows
    dequantised)."""

    def states_at(mask_nA: Tensor) -> Tensor:
        rows = states_nAH[mask_nA]
        return rows.states() if isinstance(rows, StoredAux) else rows

    non_finite_nA, zero_nA = ~torch.isfinite(norm_nA), norm_nA == 0
    if non_finite_nA.any():
        non_finite_nA[non_finite_nA.clone()] = ~torch.isfinite(states_at(non_finite_nA)).all(dim=-1)
    if zero_nA.any():
        zero_nA[zero_nA.clone()] = (states_at(zero_nA) == 0).all(dim=-1)
    return zero_nA, non_finite_nA


def sample_rows(sample: RawSample) -> SampleRows:
    """The row facts of one sample's stored rows (its aux states as read back: fp8 dequantised)."""
    norm_nA = state_norms(sample.aux)  # (fp8: dequantised a chunk at a time, never whole)
    zero_nA, non_finite_nA = zero_and_non_finite(sample.aux, norm_nA)
    logprobs_nk = sample.topk_logprobs_nk.float()
    next_n1 = sample.next_tokens_n1.numpy()
    predicting_n1k = sample.topk_ids_nk[:-1].numpy()  # topk[i] for the rows i that have a next token
    return SampleRows(
        norm_nA=norm_nA.numpy(),
        zero_nA=zero_nA.numpy(),
        non_finite_nA=non_finite_nA.numpy(),
        mass_n=logprobs_nk.exp().sum(dim=-1).numpy(),
        topk_non_finite_n=(~torch.isfinite(logprobs_nk).all(dim=-1)).numpy(),
        agree_n1=predicting_n1k[:, 0] == next_n1,
        in_topk_n1=(predicting_n1k == next_n1[:, None]).any(axis=1),
        supervised_n1=sample.next_supervised_n1.numpy(),
    )


def mass_bounds(settings: S.StoreSettings) -> tuple[float, float]:
    """(lowest, highest) plausible top-k mass: any k of V probabilities summing to 1 hold at least k/V
    of it (half that, for float16 rounding of log-probs near log(1/V)); more than 1 + tolerance is not a
    log-softmax."""
    return settings.topk / (2.0 * settings.target.vocab_size), 1.0 + S.MASS_TOLERANCE


def _round(x: float) -> float:
    return float(f"{x:.6g}") if math.isfinite(x) else 0.0


def _layer_stats(norm: np.ndarray, zero: np.ndarray, non_finite: np.ndarray, usable: np.ndarray) -> S.LayerStats:
    values = norm[usable].astype(np.float64)
    logs = np.log(values) if values.size else values
    return S.LayerStats(
        num_rows=int(zero.size), zero_rows=int(zero.sum()), non_finite_rows=int(non_finite.sum()),
        norm_rows=int(values.size),
        norm_mean=_round(values.mean()) if values.size else 0.0, norm_std=_round(values.std()) if values.size else 0.0,
        norm_min=_round(values.min()) if values.size else 0.0, norm_max=_round(values.max()) if values.size else 0.0,
        log_norm_mean=_round(logs.mean()) if values.size else 0.0,
        log_norm_std=_round(logs.std()) if values.size else 0.0,
    )


def shard_stats(rows: list[SampleRows], settings: S.StoreSettings) -> S.ShardStats:
    """A shard's statistics from its samples' row facts (rows in store order)."""
    num_aux = len(settings.aux_layer_ids)
    if rows:
        cat = np.concatenate
        norm, zero = cat([r.norm_nA for r in rows]), cat([r.zero_nA for r in rows])
        non_finite, usable = cat([r.non_finite_nA for r in rows]), cat([r.norm_rows_nA() for r in rows])
        mass, topk_bad = cat([r.mass_n for r in rows]).astype(np.float64), cat([r.topk_non_finite_n for r in rows])
        agree = cat([r.agree_n1[r.supervised_n1] for r in rows])
    else:
        norm = np.zeros((0, num_aux), np.float32)
        zero = non_finite = usable = np.zeros((0, num_aux), bool)
        mass, topk_bad, agree = np.zeros(0), np.zeros(0, bool), np.zeros(0, bool)
    low, high = mass_bounds(settings)
    finite_mass = mass[~topk_bad]
    return S.ShardStats(
        layers=tuple(_layer_stats(norm[:, a], zero[:, a], non_finite[:, a], usable[:, a]) for a in range(num_aux)),
        topk=S.TopkStats(
            num_rows=int(mass.size), non_finite_rows=int(topk_bad.sum()),
            mass_high_rows=int((finite_mass > high).sum()), mass_low_rows=int((finite_mass < low).sum()),
            mass_mean=_round(finite_mass.mean()) if finite_mass.size else 0.0,
            mass_min=_round(finite_mass.min()) if finite_mass.size else 0.0,
            mass_max=_round(finite_mass.max()) if finite_mass.size else 0.0,
            agree_positions=int(agree.size), agree_count=int(agree.sum()),
        ),
    )


__all__ = ["SampleRows", "mass_bounds", "sample_rows", "shard_stats", "state_norms"]
