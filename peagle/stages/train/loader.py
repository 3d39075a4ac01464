"""The training data stream: committed shards -> COD items -> packed batches, on DataLoader workers.

**Order is a pure function.** Before an epoch starts, every rank plans the whole epoch for *all*
ranks from Parquet metadata only (sample ids and token counts; ``epoch_plan.plan_epoch``: shards
spread over ranks balanced by tokens, reshuffled per epoch, mixed by store weights, packed under the
token budget, every rank cut to the same batch count so DDP never hangs).

**Workers do not change the stream.** DataLoader worker w of W builds the rank's remaining batches
w, w+W, w+2W, ...; the DataLoader's in-order round robin then yields them in canonical order. So the
stream is a function of (seed, epoch, world size, rank, store contents) for any ``num_workers``, and
an item depends only on (seed, epoch, sample_id) (``cod_generator``). The loader's state is two
integers (epoch, batches handed out) plus what must not change; resume = re-plan the epoch, skip.

**Workers do the CPU work** (docs/performance.md): they read samples through the store reader
(``peagle.pipeline.store_reader.ShardReader``: training coordinates, shard tensors memory-mapped,
only the rows of a batch touched), draw COD, pack, gather top-k targets at supervised elements,
and compute segment plans and flex block indices. The trainer receives finished ``TrainBatch``es
(pinned when ``pin_memory``). Batches of an fp8 store keep their fp8 rows for the device
(``dequantize_in_workers`` False) or are dequantised in the workers (CPU training).

**Which stores may train, and together** (complete, same target and encoding, no broken rows by
their commit statistics) is ``training_stores.py``'s to say.

**A growing store** (``--follow``) or a recorded consumption (``--epoch-shards``): a *source*
(``follow.py``) decides which committed shards each epoch covers when it begins; the epoch is then
planned over exactly those, and the decision is part of the loader state. Without a source every
epoch covers the shards committed when the loader opened the stores.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, replace
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from peagle.pipeline.atomic import canonical_json
from peagle.pipeline.split import is_heldout
from peagle.pipeline.store import Store, check_shards, manifest_hash, open_store
from peagle.pipeline.store_reader import ShardReader, read_num_positions
from peagle.schemas.cod_settings import CodSettings
from peagle.schemas.errors import UserError
from peagle.schemas.loader_config import LoaderConfig
from peagle.stages.train.batch import collate, make_item
from peagle.stages.train.epoch_plan import EpochPlan, PlanSettings, SampleIndex, plan_epoch, worker_batches
from peagle.stages.train.follow import EpochShards, check_still_committed
from peagle.stages.train.methods import training_method
from peagle.stages.train.train_batch import TrainBatch
from peagle.stages.train.training_stores import check_commit_stats, open_training_stores
from peagle.stages.train.vocab import DraftVocab

log = logging.getLogger(__name__)

STATE_VERSION = 1


def plan_settings(config: LoaderConfig) -> PlanSettings:
    """The part of the loader config the epoch plan depends on."""
    return PlanSettings(seed=config.seed, token_budget=config.token_budget, shuffle=config.shuffle,
                        shuffle_window=config.shuffle_window, weights=tuple(s.weight for s in config.stores))


# --------------------------------------------------------------------------------------------------
# Opening


# --------------------------------------------------------------------------------------------------
# Metadata (Parquet columns only)


def build_sample_index(stores: list[Store], config: LoaderConfig,
                       cache: dict[tuple[str, int], tuple[list[str], np.ndarray]] | None = None, *,
                       warn: bool = True) -> SampleIndex:
    """Sample ids and training lengths of every committed shard (no tensors, no token columns); ``cache``
    keeps each shard's columns for the next epoch of a growing store."""
    store_of, shard_of, row_of, positions, ids = [], [], [], [], []
    cache = {} if cache is None else cache
    for s, store in enumerate(stores):
        for j, record in enumerate(store.shards):
            key = (str(store.root), record.index)
            if key not in cache:
                cache[key] = read_num_positions(store, record.index)
            sample_ids, num_positions = cache[key]
            store_of.append(np.full(num_positions.size, s, np.int32))
            shard_of.append(np.full(num_positions.size, j, np.int32))
            row_of.append(np.arange(num_positions.size, dtype=np.int32))
            positions.append(num_positions)
            ids.extend(sample_ids)
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
    positions_of = cat(positions, np.int64)
    in_split = np.ones(positions_of.size, bool)
    if config.split != "all":
        held = np.fromiter((is_heldout(i, config.heldout_fraction) for i in ids), bool, len(ids))
        in_split = held if config.split == "heldout" else ~held
    too_long = in_split & (positions_of > config.token_budget)
    if too_long.any() and warn:
        log.warning("%d samples are longer than --token-budget %d and are skipped", int(too_long.sum()),
                    config.token_budget)
    eligible = in_split & (positions_of >= 1) & ~too_long
    return SampleIndex(cat(store_of, np.int32), cat(shard_of, np.int32), cat(row_of, np.int32), positions_of,
                       eligible, ids, int(too_long.sum()))


# --------------------------------------------------------------------------------------------------
# Building batches (runs in DataLoader workers)


class ShardStream(IterableDataset):
    """One rank's batches ``start..num_batches-1`` of one epoch; worker w builds w, w+W, ... of them."""

    def __init__(self, stores: list[Store], config: LoaderConfig, *, loc_3B: np.ndarray, bounds: np.ndarray,
                 num_batches: int, start: int, epoch: int, target_to_draft_V: torch.Tensor):
        self.stores, self.config = stores, config
        self.loc_3B, self.bounds = loc_3B, bounds  # (store, shard, row) of the rank's refs, batch bounds
        self.num_batches, self.start, self.epoch = num_batches, start, epoch
        self.target_to_draft_V = target_to_draft_V
        self.method = training_method(config.method)

    def __iter__(self) -> Iterator[TrainBatch]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        reader = ShardReader(self.stores, capacity=self.config.shuffle_window * len(self.stores) + 2)
        for b in worker_batches(self.num_batches, self.start, worker, num_workers):
            yield self.build(reader, b)

    def build(self, reader: ShardReader, batch: int) -> TrainBatch:
        """Batch ``batch`` of the rank's plan, with its aux rows left on disk (``TrainBatch.aux_source``)."""
        items, aux_reads, sources = [], [], []
        for i in range(self.bounds[batch], self.bounds[batch + 1]):
            store, shard, row = (int(v) for v in self.loc_3B[:, i])
            aux_reads.append(reader.aux_read(store, shard, row))
            sources.append((str(self.stores[store].root), self.stores[store].shards[shard].index))
            items.append(make_item(reader.sample(store, shard, row), cod=self.config.cod, seed=self.config.seed,
                                   epoch=self.epoch, method=self.method))
        out = collate(items, target_to_draft_V=self.target_to_draft_V, num_segments=self.config.sequence_partitions,
                      block_size=self.config.block_size if self.config.attention == "flex" else None,
                      epoch=self.epoch, batch_index=batch, aux_reads=aux_reads, method=self.method)
        out.sources = tuple(sources)
        fp8_rows = out.aux_source is not None and out.aux_source.scale_reads is not None
        return out.dequantized() if fp8_rows and self.config.dequantize_in_workers else out


# --------------------------------------------------------------------------------------------------
# The loader the trainer holds


EpochSource = Callable[[int, "EpochShards | None"], EpochShards]
"""``(epoch, the previous epoch's shards) -> this epoch's shards`` (``follow.FollowSource``, ``ReplaySource``)."""


class TrainLoader:
    """The batch stream of one rank, with resumable state (module docstring).

    ``for batch in loader`` yields the rest of the current epoch and then moves to the next epoch;
    ``stream()`` goes on forever. ``state_dict()`` counts batches handed out (not prefetched).

    With a ``source`` (a growing store, or a recorded consumption), each epoch covers the shards the
    source decides when the epoch begins: rank 0's decision, taken by every rank through ``agree``
    (a broadcast from rank 0 under DDP); ``on_epoch`` hears of each decision (the run's record).
    """

    def __init__(self, config: LoaderConfig, *, vocab: DraftVocab | None = None, rank: int = 0,
                 world_size: int = 1, source: EpochSource | None = None,
                 agree: Callable[[Any], Any] = lambda decided: decided,
                 on_epoch: Callable[[int, EpochShards], None] | None = None):
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside world size {world_size}")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.source, self.agree, self.on_epoch = source, agree, on_epoch
        self.stores = open_training_stores(config, growing=source is not None)
        settings = self.stores[0].settings
        vocab_size = settings.target.vocab_size
        if vocab is not None and vocab.target_vocab_size != vocab_size:
            raise UserError(f"draft vocab was built for target vocab {vocab.target_vocab_size}, store "
                            f"{self.stores[0].root} has target vocab {vocab_size}")
        self.target_to_draft_V = vocab.target_to_draft() if vocab is not None else torch.arange(vocab_size)
        self.manifest_hashes = [manifest_hash(store.root) for store in self.stores]
        self.epoch, self.batch_in_epoch = 0, 0
        self.epoch_shards: dict[int, EpochShards] = {}  # with a source: the shards of every epoch begun
        self._columns: dict[tuple[str, int], tuple[list[str], np.ndarray]] = {}
        self._too_long_said = 0
        self.index = None if source is not None else build_sample_index(self.stores, config, self._columns)
        # The plans of the last two epochs asked for: stream() plans the next epoch before this one ends.
        self._plans: dict[int, tuple[EpochPlan, list[Store], SampleIndex]] = {}
        if source is None and config.split == "train" and self.plan(0).num_batches == 0:
            raise UserError(f"the training stores hold {int(self.index.eligible.sum())} usable samples: not "
                            f"one batch per rank for world size {world_size}")

    def plan(self, epoch: int) -> EpochPlan:
        return self._epoch(epoch)[1]

    def _epoch(self, epoch: int) -> tuple[int, EpochPlan, list[Store], SampleIndex]:
        """The epoch's plan, with the stores (as of the epoch's shards) and the sample index it plans over."""
        if epoch not in self._plans:
            stores, index = self._view(epoch)
            self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
            self._plans[epoch] = (plan_epoch(index, plan_settings(self.config), epoch, self.world_size), stores, index)
        return (epoch, *self._plans[epoch])

    def _view(self, epoch: int) -> tuple[list[Store], SampleIndex]:
        """The stores and sample index of ``epoch``: everything opened, or the shards its source decided
        (waiting for more while they give no batch: a growing store's first shards may all be held out)."""
        if self.source is None:
            return self.stores, self.index
        recorded = self.epoch_shards.get(epoch)
        if recorded is not None:  # resumed, or asked again: the shards the epoch began with
            check_still_committed([s.root for s in self.stores], epoch, recorded)
            return self._restricted(recorded)
        decided = self.agree(self.source(epoch, self.epoch_shards.get(epoch - 1)))
        stores, index = self._restricted(decided)
        while self.config.split == "train" and plan_epoch(index, plan_settings(self.config), epoch,
                                                          self.world_size).num_batches == 0:
            if decided.complete:
                raise UserError(f"the training stores hold {int(index.eligible.sum())} usable samples: not "
                                f"one batch per rank for world size {self.world_size}")
            decided = self.agree(self.source(epoch, decided))
            stores, index = self._restricted(decided)
        self.epoch_shards[epoch] = decided
        if self.on_epoch is not None:
            self.on_epoch(epoch, decided)
        return stores, index

    def _restricted(self, decided: EpochShards) -> tuple[list[Store], SampleIndex]:
        """Each store opened now, holding only the decided shards (their commit statistics checked)."""
        stores = []
        for store, shards in zip(self.stores, decided.shards):
            now, wanted = open_store(store.root), set(shards)  # sizes; --verify hashes each shard once:
            stores.append(replace(now, shards=[r for r in now.shards if r.index in wanted]))
            new = [r for r in stores[-1].shards if (str(now.root), r.index) not in self._columns]
            problems = check_shards(now.root, new, verify=True) if self.config.verify else []
            if problems:
                raise UserError(f"store {now.root} is damaged: {problems[0]}")
            if not self.config.allow_bad_aux_rows:
                check_commit_stats(stores[-1])
        index = build_sample_index(stores, self.config, self._columns, warn=False)
        if index.num_too_long > self._too_long_said:  # once, not every epoch of a growing store
            self._too_long_said = index.num_too_long
            log.warning("%d samples are longer than --token-budget %d and are skipped", index.num_too_long,
                        self.config.token_budget)
        return stores, index

    @property
    def num_batches(self) -> int:
        """Batches per epoch on this rank (equal on every rank)."""
        return self.plan(self.epoch).num_batches

    def batches(self, epoch: int, start: int = 0) -> Iterator[TrainBatch]:
        """Batches ``start..`` of ``epoch`` on this rank, built by ``num_workers`` workers; no state change."""
        _, plan, stores, index = self._epoch(epoch)
        refs, bounds = plan.refs_of_rank[self.rank], plan.bounds_of_rank[self.rank]
        used = refs[:bounds[plan.num_batches]]
        loc_3B = np.stack([index.store_of[used], index.shard_of[used], index.row_of[used]])
        dataset = ShardStream(stores, self.config, loc_3B=loc_3B, bounds=bounds[:plan.num_batches + 1],
                              num_batches=plan.num_batches, start=start, epoch=epoch,
                              target_to_draft_V=self.target_to_draft_V)
        workers = self.config.num_workers
        # A dedicated generator: without one, every new iterator draws its workers' base seed from the
        # global torch RNG, so a resumed run (one more iterator) would end one draw ahead (docs/reliability.md).
        loader = DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=self.config.pin_memory,
                            prefetch_factor=self.config.prefetch_factor if workers else None,
                            generator=torch.Generator().manual_seed(self.config.seed + epoch))
        # With pin_memory the pin thread reads the aux rows into pinned memory; otherwise read them here.
        return iter(loader) if self.config.pin_memory else (batch.materialize() for batch in loader)

    def __iter__(self) -> Iterator[TrainBatch]:
        """The rest of the current epoch (the position moves as batches are handed out)."""
        yield from self._rest_of_epoch(self.batches(self.epoch, self.batch_in_epoch))

    def _rest_of_epoch(self, batches: Iterator[TrainBatch], *,
                       on_batch: Callable[[int, int, int], None] | None = None) -> Iterator[TrainBatch]:
        """``batches`` (the current epoch's from the current position), moving the position past each
        one before it is handed out; ``on_batch(epoch, i, num_batches)`` hears of batch ``i`` first."""
        epoch, start = self.epoch, self.batch_in_epoch
        num_batches = self.plan(epoch).num_batches
        assert start < num_batches or num_batches == 0, "the position is always inside an epoch"
        for i, batch in enumerate(batches, start=start):
            if i + 1 >= num_batches:
                self.epoch, self.batch_in_epoch = epoch + 1, 0
            else:
                self.batch_in_epoch = i + 1
            if on_batch is not None:
                on_batch(epoch, i, num_batches)
            yield batch

    @property
    def batches_in_flight(self) -> int:
        """How many batches the workers build ahead of the consumer (DataLoader's prefetch)."""
        return self.config.num_workers * self.config.prefetch_factor if self.config.num_workers else 0

    def stream(self) -> Iterator[TrainBatch]:
        """Every batch of every epoch from the current position on, forever.

        The next epoch's workers start as soon as the current epoch's have built their last batch (its
        last ``batches_in_flight`` are then queued, the workers idle): a new epoch's workers take a
        while to start and open the shards, and the 2026-11-27 H200 run waited 0.29 s at the epoch
        boundary, 25 % of a 20-step run's time. A followed or recorded source decides an epoch's shards
        when it begins, so there the next epoch still starts at the boundary.
        """
        upcoming: Iterator[TrainBatch] | None = None

        def start_next_epoch(epoch: int, i: int, num_batches: int) -> None:
            nonlocal upcoming
            if (upcoming is None and self.source is None and i + 1 + self.batches_in_flight >= num_batches
                    and self.plan(epoch + 1).num_batches > 0):
                upcoming = self.batches(epoch + 1)

        while True:
            if self.plan(self.epoch).num_batches == 0:
                raise UserError(f"epoch {self.epoch} has no batch on rank {self.rank}: too few samples for "
                                f"world size {self.world_size} (split {self.config.split})")
            batches = upcoming if upcoming is not None else self.batches(self.epoch, self.batch_in_epoch)
            upcoming = None
            yield from self._rest_of_epoch(batches, on_batch=start_next_epoch)

    # ---------------------------------------------------------------------------------------------- state

    def _identity(self) -> dict[str, Any]:
        """What the stream depends on besides (epoch, position): must be equal to resume."""
        c = self.config
        return {
            "seed": c.seed, "world_size": self.world_size, "token_budget": c.token_budget, "split": c.split,
            "heldout_fraction": c.heldout_fraction, "shuffle": c.shuffle, "shuffle_window": c.shuffle_window,
            **{f"cod.{k}": v for k, v in asdict(c.cod).items()},
            **({"method": c.method} if c.method != "peagle" else {}),  # absent: P-EAGLE, as before methods
            **self._store_identities(),
        }

    def _store_identities(self) -> dict[str, str]:
        """A store is its committed content (manifest hash), wherever it is mounted now; a growing one is
        its settings (what each epoch held is in ``epoch_shards``, checked when the epoch is planned)."""
        if self.source is None:
            return {f"store[{i}]": f"manifest {h[:16]}, weight {spec.weight}"
                    for i, (spec, h) in enumerate(zip(self.config.stores, self.manifest_hashes))}
        return {f"store[{i}]": f"settings {_settings_digest(store)[:16]}, weight {spec.weight}, shards per epoch"
                for i, (spec, store) in enumerate(zip(self.config.stores, self.stores))}

    def state_dict(self) -> dict[str, Any]:
        state = {"version": STATE_VERSION, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                 "identity": self._identity()}
        if self.source is not None:
            state["epoch_shards"] = {str(e): shards.to_dict() for e, shards in sorted(self.epoch_shards.items())}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Raises UserError (one line) when the stream would differ."""
        if state.get("version") != STATE_VERSION:
            raise UserError(f"loader state has version {state.get('version')}, this peagle reads {STATE_VERSION}")
        saved, now = state["identity"], self._identity()
        # a COD knob added after the checkpoint was written: it had that knob's default
        saved = {**{f"cod.{k}": v for k, v in asdict(CodSettings()).items()}, **saved}
        for key in sorted(set(saved) | set(now), key=lambda k: (k != "seed", k != "world_size", k)):
            if saved.get(key) != now.get(key):
                raise UserError(f"the checkpointed data stream had {key}={saved.get(key)}, this run has "
                                f"{key}={now.get(key)}; resume with the same setting (or start a new run)")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        if self.source is not None:  # epochs begun after the checkpoint begin again, with what is committed then
            self.epoch_shards = {int(e): EpochShards.from_dict(d) for e, d in state.get("epoch_shards", {}).items()}
            self._plans = {}


def _settings_digest(store: Store) -> str:
    return hashlib.sha256(canonical_json(store.settings.to_dict())).hexdigest()
