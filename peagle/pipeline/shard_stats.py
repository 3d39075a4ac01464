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


def sample_rows(sample: RawSample) -> SampleRows:
    """The row facts of one sample's stored rows (its aux states as read back: fp8 dequantised)."""
    states_nAH = sample.aux_nAH.float()
    finite_nAH = torch.isfinite(states_nAH)
    logprobs_nk = sample.topk_logprobs_nk.float()
    next_n1 = sample.next_tokens_n1.numpy()
    predicting_n1k = sample.topk_ids_nk[:-1].numpy()  # topk[i] for the rows i that have a next token
    return SampleRows(
        norm_nA=torch.linalg.vector_norm(states_nAH, dim=-1).numpy(),
        zero_nA=(states_nAH == 0).all(dim=-1).numpy(),
        non_finite_nA=(~finite_nAH.all(dim=-1)).numpy(),
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


__all__ = ["SampleRows", "mass_bounds", "sample_rows", "shard_stats"]
