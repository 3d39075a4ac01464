"""What `peagle train` trains and evaluates on, and how its loader reads it: the ``data`` part of ``TrainConfig``.

The stores (``STORE[:WEIGHT]``, :class:`StoreSpec`), the evaluation split, the loader's budget and
workers, and what an unfinished or growing store may do (``--allow-incomplete``, ``--follow``). The
trainer makes one ``LoaderConfig`` per stream from this part (``loader_config.stream_config``): the
training stream takes it as written, the evaluation stream its eval store or held-out split, read in
the training process. Its fields are `peagle train` flags of the same names (the docstrings are their
help); what needs another part (``--follow`` needs ``--max-steps``) is checked by ``TrainConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peagle.schemas.errors import UserError, at_least


@dataclass(frozen=True)
class StoreSpec:
    """One training store and its mixing weight (``PATH`` or ``PATH:WEIGHT``)."""

    path: str
    weight: float = 1.0


def parse_store_spec(text: str) -> StoreSpec:
    """``/data/a`` -> (``/data/a``, 1.0); ``/data/a:0.7`` -> (``/data/a``, 0.7).

    Only a suffix that parses as a number is a weight, so paths that contain ``:`` still work.
    """
    path, sep, tail = str(text).rpartition(":")
    if sep and path:
        try:
            weight = float(tail)
        except ValueError:
            return StoreSpec(str(text), 1.0)
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"--store {text}: the weight after ':' must be a positive number, got {tail!r}")
        return StoreSpec(path, weight)
    return StoreSpec(str(text), 1.0)


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """The stores of a run, its evaluation data, and how the loader packs and checks them."""

    store: tuple[str, ...]
    """Shard store(s) written by `peagle extract`, as STORE or STORE:WEIGHT. Repeat the flag to mix
    stores: each batch draws samples from store i with probability weight_i / sum(weights)."""

    eval_store: str | None = None
    """Store to evaluate on every --eval-every steps. Without it, a --heldout-fraction of the
    training samples (chosen by sample_id hash) is held out for evaluation."""

    token_budget: int = 16384
    """Training positions per micro-batch on each rank: samples (n tokens give n - 1 positions) are
    packed into one row up to this; COD then adds the deeper-depth elements on top."""

    num_workers: int = 2
    """DataLoader worker processes per rank doing COD sampling, packing and mask metadata (0: in
    the training process)."""

    heldout_fraction: float = 0.01
    """Share of training samples held out for evaluation when no --eval-store is given (0: none)."""

    verify: bool = False
    """Check the sha256 of every shard when opening the stores (default: sizes only)."""

    allow_bad_aux_rows: bool = False
    """Train on stores whose commit statistics show all-zero or non-finite aux rows (by default such
    a store is refused, naming the shard: `peagle store check --store STORE` finds the samples)."""

    allow_incomplete: bool = False
    """Train on stores with planned shards that are not committed (a worker died, or is still at work),
    saying how much is missing; by default such a store is refused, naming the missing shards
    (`peagle store info --store STORE` prints the command that extracts them)."""

    follow: bool = False
    """Train while extraction still commits into the stores: start once a shard is committed; each epoch
    covers the shards committed when it begins (while a store is incomplete, a new epoch waits for a new
    commit rather than repeat the same data). Needs --max-steps; the draft vocab is the one built before
    the run starts (`peagle vocab --store STORE --allow-incomplete`), frozen for the run. RUN_DIR/epochs.json
    records the shards of every epoch; a store still incomplete when the steps are spent is an error
    (after the final checkpoint) unless --allow-incomplete."""

    follow_timeout: float = 3600.0
    """With --follow: seconds to wait for the first (or a next) committed shard before giving up with one
    line naming the missing shards (re-running the same command then resumes)."""

    epoch_shards: str | None = None
    """Train epoch e on exactly the shards FILE records for it (the RUN_DIR/epochs.json of a --follow run;
    epochs it does not list cover every committed shard): repeats that run's consumption on the
    finished store, step for step."""

    def __post_init__(self) -> None:
        store = (self.store,) if isinstance(self.store, str) else tuple(self.store or ())
        object.__setattr__(self, "store", store)
        if not store:
            raise UserError("no training store: pass --store PATH (or PATH:WEIGHT; repeat to mix stores)")
        self.stores()  # validates weights
        if self.follow and self.epoch_shards is not None:
            raise UserError("--follow and --epoch-shards are exclusive: --epoch-shards repeats a finished --follow run")
        if not (math.isfinite(self.follow_timeout) and self.follow_timeout > 0):
            raise UserError(f"--follow-timeout must be > 0 seconds, got {self.follow_timeout}")
        at_least("token_budget", self.token_budget, 1)
        at_least("num_workers", self.num_workers, 0)
        if not 0 <= self.heldout_fraction < 1:
            raise UserError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")

    def stores(self) -> list[StoreSpec]:
        """The training stores with their weights, in the order given."""
        return [parse_store_spec(s) for s in self.store]
