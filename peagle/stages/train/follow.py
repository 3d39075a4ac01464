"""Training while extraction still commits (`peagle train --follow`), and repeating such a run on the
finished store (`--epoch-shards`): which committed shards each epoch covers, and the record of it.

**Each epoch covers what was committed when it began.** The shards of an epoch are fixed when its
first batch is asked for (rank 0 decides, every rank takes its decision), and the epoch plan is then
the same pure function of them as for any store (``epoch_plan``): order, COD draws and batches do not
depend on when commits arrive, only on which shards each epoch holds.

**A new epoch waits for news.** While a store is incomplete, an epoch begins only once a shard was
committed since the previous epoch began (training does not repeat the same partial data while
extraction is still under way; it waits, saying so, for at most ``follow_timeout`` seconds between
commits). Once every store is complete, every epoch covers all of it.

**The record.** Each epoch's shards, with a sha256 over their commit records, are part of the loader
state (a resumed run re-plans its current epoch from exactly those) and, for people and for
``--epoch-shards``, ``RUN_DIR/epochs.json``: one entry per epoch begun, with the step it began at and
how much of each store's plan was committed then. A run given that file as ``--epoch-shards`` on the
finished store consumes the same shards in the same order, so it ends with the same weights.

**The end.** A follow run ends when its step budget (``--max-steps``) is spent. A store still
incomplete then is one line (exit 2, after the final checkpoint is written) naming the missing shards,
unless ``--allow-incomplete``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from peagle.pipeline.atomic import canonical_json
from peagle.pipeline.plan import format_ranges, plural, store_completeness
from peagle.pipeline.store import list_commits
from peagle.schemas import store as S
from peagle.schemas.errors import UserError

EPOCHS_FILE = "epochs.json"
EPOCHS_VERSION = 1
POLL_SECONDS = 1.0  # how often a waiting run looks for new commit records


@dataclass(frozen=True, kw_only=True)
class EpochShards:
    """The committed shards one epoch covers, per training store, and what identifies them."""

    shards: tuple[tuple[int, ...], ...]  # per store, ascending shard indices
    commits_sha256: tuple[str, ...]  # per store: sha256 over those shards' commit records
    num_planned: tuple[int, ...]  # per store: shards of its plan when the epoch began (0: none recorded)

    @property
    def complete(self) -> bool:
        return all(len(s) >= n for s, n in zip(self.shards, self.num_planned))

    def to_dict(self) -> dict[str, Any]:
        return {"shards": [list(s) for s in self.shards], "commits_sha256": list(self.commits_sha256),
                "num_planned": list(self.num_planned)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpochShards":
        return cls(shards=tuple(tuple(int(i) for i in s) for s in d["shards"]),
                   commits_sha256=tuple(d["commits_sha256"]), num_planned=tuple(int(n) for n in d["num_planned"]))


def commits_sha256(records: list[S.ShardRecord]) -> str:
    """sha256 over commit records (canonical JSON, by index): equal only for the same committed shards."""
    return hashlib.sha256(canonical_json([r.to_dict() for r in sorted(records, key=lambda r: r.index)])).hexdigest()


def snapshot(roots: list[Path]) -> EpochShards:
    """Every shard committed now, per store."""
    shards, digests, planned = [], [], []
    for root in roots:
        records = list_commits(root)
        shards.append(tuple(r.index for r in records))
        digests.append(commits_sha256(records))
        planned.append(len(store_completeness(root, shards[-1]).planned))
    return EpochShards(shards=tuple(shards), commits_sha256=tuple(digests), num_planned=tuple(planned))


def check_still_committed(roots: list[Path], epoch: int, recorded: EpochShards) -> None:
    """The shards an epoch was recorded with still hold the same commit records (resume, --epoch-shards).

    Raises:
        UserError: a shard is gone or was committed again with other content.
    """
    for root, shards, digest in zip(roots, recorded.shards, recorded.commits_sha256):
        records = {r.index: r for r in list_commits(root)}
        gone = [i for i in shards if i not in records]
        if gone or commits_sha256([records[i] for i in shards]) != digest:
            what = f"{plural(len(gone), 'shard')} {format_ranges(gone)} no longer committed" if gone else \
                "its shards' commit records differ"
            raise UserError(f"epoch {epoch} was recorded with shards {format_ranges(shards)} of store {root}, but "
                            f"{what}: the store changed since; train on it with a new --out")


class FollowSource:
    """Decides the shards of each epoch of a ``--follow`` run (module docstring)."""

    def __init__(self, roots: list[Path], *, timeout_s: float, say: Callable[[str], None],
                 poll_s: float = POLL_SECONDS):
        self.roots, self.timeout_s, self.say, self.poll_s = roots, timeout_s, say, poll_s

    def __call__(self, epoch: int, previous: EpochShards | None) -> EpochShards:
        """What is committed now, once it holds a shard ``previous`` did not (or every store is complete)."""
        now = snapshot(self.roots)
        if self._news(now, previous):
            return now
        self.say(f"epoch {epoch}: waiting for extraction to commit a new shard "
                 f"({self._progress(now)}; --follow-timeout {self.timeout_s:g} s)")
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(self.poll_s)
            now = snapshot(self.roots)
            if self._news(now, previous):
                return now
        missing = [f"store {root}: {store_completeness(root, shards).describe()}"
                   for root, shards in zip(self.roots, now.shards)]
        raise UserError(f"no shard was committed for {self.timeout_s:g} s while training waited for one "
                        f"({'; '.join(missing)}): is extraction still running? Finish it (`peagle store info "
                        "--store STORE` prints the command) and re-run this command: it resumes")

    @staticmethod
    def _news(now: EpochShards, previous: EpochShards | None) -> bool:
        if not any(now.shards):
            return False
        return previous is None or now.complete or any(set(a) - set(b) for a, b in zip(now.shards, previous.shards))

    def _progress(self, now: EpochShards) -> str:
        return ", ".join(f"{len(s)} of {n} shards of {root.name} committed"
                         for root, s, n in zip(self.roots, now.shards, now.num_planned))


class ReplaySource:
    """The shards of each epoch as a ``--follow`` run recorded them (``--epoch-shards FILE``); epochs the
    record does not list cover every committed shard."""

    def __init__(self, roots: list[Path], path: str | Path):
        self.roots = roots
        self.epochs = read_epochs(path, num_stores=len(roots))

    def __call__(self, epoch: int, previous: EpochShards | None) -> EpochShards:
        recorded = self.epochs.get(epoch)
        if recorded is None:
            return snapshot(self.roots)
        check_still_committed(self.roots, epoch, recorded)
        return recorded


# --------------------------------------------------------------------------------------------------
# RUN_DIR/epochs.json


def epochs_record(roots: list[Path], epochs: dict[int, EpochShards], began_at: dict[int, int]) -> dict[str, Any]:
    """The record of which commit records each epoch consumed (module docstring)."""
    return {"version": EPOCHS_VERSION, "stores": [str(r) for r in roots],
            "epochs": [{"epoch": e, "began_at_step": began_at.get(e), **epochs[e].to_dict(),
                        "complete": epochs[e].complete} for e in sorted(epochs)]}


def read_epochs(path: str | Path, *, num_stores: int) -> dict[int, EpochShards]:
    """Epoch -> shards of an ``epochs.json``.

    Raises:
        UserError: unreadable, of another version, or for another number of stores.
    """
    try:
        d = json.loads(Path(path).read_text())
        if d.get("version") != EPOCHS_VERSION:
            raise UserError(f"--epoch-shards {path} has version {d.get('version')}, this peagle reads {EPOCHS_VERSION}")
        epochs = {int(e["epoch"]): EpochShards.from_dict(e) for e in d["epochs"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"--epoch-shards {path} is not an epochs record of a --follow run ({err})") from err
    if any(len(e.shards) != num_stores for e in epochs.values()):
        raise UserError(f"--epoch-shards {path} records {len(d['stores'])} stores, this run trains on {num_stores}")
    return epochs


def wait_for_first_commit(roots: list[Path], *, timeout_s: float, say: Callable[[str], None],
                          poll_s: float = POLL_SECONDS) -> None:
    """Wait until every store exists and has a committed shard (a --follow run may start first).

    Raises:
        UserError: a store still has none after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        empty = [r for r in roots if not (r / S.STORE_SETTINGS_FILE).exists() or not list_commits(r)]
        if not empty:
            return
        if time.monotonic() >= deadline:
            raise UserError(f"store {empty[0]} has no committed shard after {timeout_s:g} s (--follow-timeout): "
                            "start `peagle extract --out` it, or check the path")
        if not said:
            say(f"waiting for the first committed shard of {', '.join(map(str, empty))}")
            said = True
        time.sleep(poll_s)


def epoch_source(roots: list[Path], *, follow: bool, epoch_shards: str | None, timeout_s: float,
                 say: Callable[[str], None]) -> FollowSource | ReplaySource | None:
    """The source of a run's epochs: following the stores, repeating a record, or none (a plain run)."""
    if follow:
        return FollowSource(roots, timeout_s=timeout_s, say=say)
    if epoch_shards is not None:
        return ReplaySource(roots, epoch_shards)
    return None


def end_of_follow(now: EpochShards, roots: list[Path], consumed: dict[int, EpochShards], *, max_steps: int,
                  allow_incomplete: bool) -> list[str]:
    """What a --follow run says when its steps are spent: nothing when every store is complete and every
    shard was trained on; warnings for shards committed too late to be trained on.

    Raises:
        UserError: a store is still incomplete, unless ``allow_incomplete`` (then a warning).
    """
    lines = []
    for i, root in enumerate(roots):
        completeness = store_completeness(root, now.shards[i])
        if not completeness.complete:
            line = (f"the {max_steps} steps of --max-steps are spent but store {root} is still incomplete "
                    f"({completeness.describe()}): the draft never saw the missing shards; finish extraction and "
                    "re-run this command with a larger --max-steps (it resumes from the final checkpoint)")
            if not allow_incomplete:
                raise UserError(line + ", or pass --allow-incomplete to end here")
            lines.append(f"warning: {line} (--allow-incomplete: ending here)")
        seen = {shard for shards in consumed.values() for shard in shards.shards[i]}
        late = sorted(set(now.shards[i]) - seen)
        if late:
            lines.append(f"warning: {plural(len(late), 'shard')} {format_ranges(late)} of store {root} were committed "
                         "after the last epoch began and were not trained on (a larger --max-steps trains on them)")
    return lines
