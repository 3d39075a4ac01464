"""Which samples each rank trains on in one epoch, in which order and batches: a pure function.

Input is metadata only (a :class:`SampleIndex`: per sample its store, shard, row and training
length); output is an :class:`EpochPlan` for *every* rank. No I/O, no global RNG: the same
(metadata, settings, epoch, world size) give the same plan on every process, which is what makes
the loader's state two integers (mosaicml/streaming's lesson). Steps:

1. units: every shard of every store with eligible samples (a store with fewer shards than ranks is
   cut into sample ranges, so that every rank gets some of every store);
2. ranks: per store, units in an order shuffled by (seed, epoch) go one by one to the rank with the
   fewest training positions so far (ties: lower rank): disjoint, covering, balanced to one unit;
3. order: per rank and store, units in that order, samples shuffled inside windows of
   ``shuffle_window`` units (an in-memory shuffle buffer that never reads outside a few shards);
4. mixing (several stores): store s gives ``weight_s / Σ weights`` of the rank's samples, cut short
   or repeated in reshuffled passes, interleaved evenly along the epoch;
5. packing: samples in order, greedily, into batches of at most ``token_budget`` positions;
6. every rank's batch list is cut to the smallest count of all ranks: DDP needs every rank to run
   the same number of steps, or the last all-reduce hangs. The cut tails are a few samples per rank
   (ranks are balanced), different ones each epoch, counted in ``num_dropped_samples``.

Random orders are argsorts of splitmix64 keys of (seed, epoch, salt, id), so they do not depend on
the numpy version either.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

_SALT_UNITS, _SALT_SAMPLES, _SALT_REPEAT = 1, 2, 3


@dataclass(frozen=True)
class SampleIndex:
    """Every sample of every store, as flat arrays (a sample's *ref* is its row here)."""

    store_of: np.ndarray  # int32: position of the store in the loader's store list
    shard_of: np.ndarray  # int32: position of the shard in Store.shards
    row_of: np.ndarray  # int32: row in the shard
    positions_of: np.ndarray  # int64: training positions n − 1
    eligible: np.ndarray  # bool: in the split, n >= 2, fits the token budget
    sample_ids: list[str]
    num_too_long: int


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    seed: int
    token_budget: int
    weights: tuple[float, ...]  # one per store
    shuffle: bool = True
    shuffle_window: int = 4


@dataclass(frozen=True)
class EpochPlan:
    """The batches of every rank for one epoch (all ranks cut to ``num_batches``)."""

    refs_of_rank: list[np.ndarray]  # int64 sample refs, in stream order (before the cut)
    bounds_of_rank: list[np.ndarray]  # batch b of rank r = refs[bounds[b]:bounds[b+1]]
    num_batches: int
    num_dropped_samples: int


def plan_epoch(index: SampleIndex, settings: PlanSettings, epoch: int, world_size: int) -> EpochPlan:
    """The epoch's batches for every rank (module docstring, steps 1-6)."""
    num_stores = len(settings.weights)
    refs_of_rank_store = [[np.zeros(0, np.int64)] * num_stores for _ in range(world_size)]
    for s in range(num_stores):
        units = _store_units(index, s, world_size)
        order = (_permutation(len(units), settings.seed, epoch, _SALT_UNITS, s) if settings.shuffle
                 else np.arange(len(units)))
        load = [(0, r) for r in range(world_size)]  # a heap of (positions so far, rank)
        units_of_rank: list[list[np.ndarray]] = [[] for _ in range(world_size)]
        for u in order:
            positions, r = heapq.heappop(load)
            units_of_rank[r].append(units[u])
            heapq.heappush(load, (positions + int(index.positions_of[units[u]].sum()), r))
        for r in range(world_size):
            refs_of_rank_store[r][s] = _shuffle_in_windows(units_of_rank[r], settings, epoch, s)
    refs_of_rank, bounds_of_rank = [], []
    for r in range(world_size):
        refs = _mix(refs_of_rank_store[r], settings, epoch)
        refs_of_rank.append(refs)
        bounds_of_rank.append(_pack(index.positions_of[refs], settings.token_budget))
    num_batches = min(len(b) - 1 for b in bounds_of_rank)
    dropped = sum(int(len(refs) - b[num_batches]) for refs, b in zip(refs_of_rank, bounds_of_rank))
    return EpochPlan(refs_of_rank, bounds_of_rank, num_batches, dropped)


def worker_batches(num_batches: int, start: int, worker: int, num_workers: int) -> range:
    """The batches DataLoader worker ``worker`` of ``num_workers`` builds: start+w, start+w+W, ...

    The DataLoader asks its workers in turn (0, 1, ..., W−1, 0, ...) and yields in that order, so the
    rank's stream is batches start, start+1, ... for any W (0 workers = the main process alone).
    """
    return range(start + worker, num_batches, max(1, num_workers))


def _mix64(*keys: Any) -> np.ndarray:
    """splitmix64 over uint64 arrays: stable, numpy-version-independent pseudo-random keys."""
    with np.errstate(over="ignore"):
        x = np.zeros(1, np.uint64)
        for k in keys:
            x = x ^ np.asarray(k, dtype=np.uint64)
            x = x + np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
    return x


def _permutation(n: int, *salt: Any) -> np.ndarray:
    return np.argsort(_mix64(*salt, np.arange(n, dtype=np.uint64)), kind="stable")


def _store_units(index: SampleIndex, store: int, world_size: int) -> list[np.ndarray]:
    """Eligible refs of each shard of one store; shards cut into ranges when there are fewer than ranks."""
    refs = np.nonzero(index.eligible & (index.store_of == store))[0]
    cuts = np.nonzero(np.diff(index.shard_of[refs]))[0] + 1
    per_shard = [u for u in np.split(refs, cuts) if u.size]
    parts = -(-world_size // max(1, len(per_shard)))
    return [p for u in per_shard for p in np.array_split(u, parts) if p.size] if parts > 1 else per_shard


def _shuffle_in_windows(units: list[np.ndarray], settings: PlanSettings, epoch: int, store: int) -> np.ndarray:
    if not units:
        return np.zeros(0, np.int64)
    if not settings.shuffle:
        return np.concatenate(units).astype(np.int64)
    out = []
    for w in range(0, len(units), settings.shuffle_window):
        window = np.concatenate(units[w:w + settings.shuffle_window]).astype(np.int64)
        keys = _mix64(settings.seed, epoch, _SALT_SAMPLES, store, window)
        out.append(window[np.argsort(keys, kind="stable")])
    return np.concatenate(out)


def _mix(refs_of_store: list[np.ndarray], settings: PlanSettings, epoch: int) -> np.ndarray:
    """Step 4: take weight shares of the rank's sample count from each store, interleave them evenly."""
    if len(refs_of_store) == 1:
        return refs_of_store[0]
    weights = np.asarray(settings.weights, dtype=np.float64)
    total = sum(r.size for r in refs_of_store)
    picked, keys, tags = [], [], []
    for s, refs in enumerate(refs_of_store):
        want = int(round(total * weights[s] / weights.sum()))
        if refs.size == 0 or want == 0:
            continue
        passes = [refs] + [_reshuffled(refs, settings, epoch, s, k) for k in range(1, -(-want // refs.size))]
        picked.append(np.concatenate(passes)[:want])
        keys.append((np.arange(want) + 0.5) / want)  # fraction of the store's share done
        tags.append(np.full(want, s))
    if not picked:
        return np.zeros(0, np.int64)
    order = np.lexsort((np.concatenate(tags), np.concatenate(keys)))
    return np.concatenate(picked)[order]


def _reshuffled(refs: np.ndarray, settings: PlanSettings, epoch: int, store: int, repeat: int) -> np.ndarray:
    """Another pass over a store's refs for up-sampling, in another order."""
    if not settings.shuffle:
        return refs
    return refs[np.argsort(_mix64(settings.seed, epoch, _SALT_REPEAT, store, repeat, refs), kind="stable")]


def _pack(positions: np.ndarray, token_budget: int) -> np.ndarray:
    """Greedy in-order packing: batch boundaries (batches + 1 of them) under the budget."""
    bounds, used = [0], 0
    for i, n in enumerate(positions.tolist()):
        if used + n > token_budget and used > 0:
            bounds.append(i)
            used = 0
        used += n
    if used > 0:
        bounds.append(len(positions))
    return np.asarray(bounds, dtype=np.int64)
