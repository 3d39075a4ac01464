"""Work planning for extract: which records form which shard, and which worker owns which shard.

The split is a pure function of the input (docs/store.md "Planning"): the records of each input file are
cut into runs of ``records_per_shard`` consecutive records, and each file owns a contiguous range of
global shard indices. The range is fixed the first time a file (identified by the sha256 of its
content, not its name) is registered in a store, under ``STORE/inputs/<sha256>.json``. Registration
runs under the store lock, so concurrent workers with the same inputs agree, a new file appended to
an existing store gets indices after every existing one, and a known file keeps its range.

Worker partitioning is World-style: worker ``shard_index`` of ``num_shards`` takes every global shard
``s`` with ``s % num_shards == shard_index``.

The registrations are the store's plan: the shards its inputs make, per input file (the range) and in
all (their union), recorded the moment a run registers its inputs, before its first shard. A store is
*complete* when every planned shard has a commit record (:class:`Completeness`): `peagle store info`
shows it, `store verify` fails without it, and `vocab` and `train` refuse an incomplete store.

A store is *usable* when it also holds something to train on (:func:`usability_problem`): a store
with neither plan nor shard, or whose every planned shard is committed without a usable sample, is
refused by every reader (docs/store.md, "The plan and completeness").

Everything except ``read_registrations``, ``register_inputs``, ``replace_registrations``,
``drop_registrations``, ``store_completeness`` and ``usability_problem`` is pure and does no I/O.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle.pipeline.atomic import atomic_write_json, file_lock
from peagle.pipeline.contained import checked_index, checked_sha256, inside
from peagle.schemas import store as S
from peagle.schemas.errors import UserError


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One input file as this run sees it."""

    path: str  # as given (this machine's path)
    sha256: str  # content hash: the file's identity in the store
    num_records: int


@dataclass(frozen=True, kw_only=True)
class InputRegistration:
    """A file's place in a store: global shards [first_shard, end_shard) hold its records in order."""

    sha256: str
    name: str  # basename at first registration (recorded in commit records)
    num_records: int
    records_per_shard: int
    first_shard: int
    end_shard: int
    path: str = ""  # absolute path at first registration ("" in registrations written before it was kept)

    def records_of(self, shard: int) -> tuple[int, int]:
        """``[first, end)`` records of this file that global shard ``shard`` holds."""
        first = (shard - self.first_shard) * self.records_per_shard
        return first, min(first + self.records_per_shard, self.num_records)


@dataclass(frozen=True, kw_only=True)
class PlannedShard:
    """One unit of work: records [first_record, end_record) of one input file -> shard ``index``."""

    index: int
    input_path: str
    input_name: str
    first_record: int
    end_record: int

    @property
    def num_records(self) -> int:
        return self.end_record - self.first_record


def record_ranges(num_records: int, records_per_shard: int) -> list[tuple[int, int]]:
    """``[first, end)`` record ranges of a file's shards: full runs of ``records_per_shard``, then the rest."""
    assert records_per_shard >= 1
    return [(first, min(first + records_per_shard, num_records))
            for first in range(0, num_records, records_per_shard)]


def num_shards_for(num_records: int, records_per_shard: int) -> int:
    return -(-num_records // records_per_shard)


def assign_registrations(existing: list[InputRegistration], files: list[InputFile],
                         records_per_shard: int) -> list[InputRegistration]:
    """The registrations that ``files`` need on top of ``existing`` (new files only, in order).

    A known file (same sha256) keeps its range; it must have been registered with the same
    ``records_per_shard``, or its shards would mean other records now.

    Raises:
        UserError: a known file was registered with another records-per-shard value.
    """
    by_hash = {r.sha256: r for r in existing}
    next_shard = max((r.end_shard for r in existing), default=0)
    new: list[InputRegistration] = []
    for f in files:
        known = by_hash.get(f.sha256)
        if known is not None:
            if known.records_per_shard != records_per_shard:
                raise UserError(f"{f.path} is already in the store with samples_per_shard="
                                f"{known.records_per_shard}, this run asks for samples_per_shard="
                                f"{records_per_shard}; use --samples-per-shard {known.records_per_shard}")
            assert known.num_records == f.num_records, (known, f)  # same content, same count
            continue
        reg = InputRegistration(sha256=f.sha256, name=Path(f.path).name, num_records=f.num_records,
                                records_per_shard=records_per_shard, first_shard=next_shard,
                                end_shard=next_shard + num_shards_for(f.num_records, records_per_shard),
                                path=str(Path(f.path).absolute()))
        by_hash[f.sha256] = reg
        new.append(reg)
        next_shard = reg.end_shard
    return new


def changed_inputs(registrations: list[InputRegistration],
                   files: list[InputFile]) -> list[tuple[InputFile, list[InputRegistration]]]:
    """The input files whose content changed since the store registered them: each file not known by
    its content, with the registrations of other content made from the same path (by name for
    registrations that kept no path).

    Why: a file is known by its sha256, so an edited file looks new and would get new shards beside
    its old ones: every unchanged record twice, silently. Such a run is refused, or told to replace
    the old version (``drop_registrations``).
    """
    known = {r.sha256 for r in registrations}
    out = []
    for f in files:
        if f.sha256 in known:
            continue
        where = str(Path(f.path).absolute())
        old = [r for r in registrations if r.path == where or (not r.path and r.name == Path(f.path).name)]
        if old:
            out.append((f, old))
    return out


def changed_refusal(root: str | os.PathLike, changed: list[tuple[InputFile, list[InputRegistration]]]) -> str:
    """The one line that refuses a run whose inputs changed (``changed_inputs``)."""
    f, old = changed[0]
    shards = sorted(s for r in old for s in range(r.first_shard, r.end_shard))
    more = f" (and {len(changed) - 1} more changed file(s))" if len(changed) > 1 else ""
    return (f"data file {f.path} changed since store {root} registered it{more} (sha256 {old[0].sha256[:12]}, now "
            f"{f.sha256[:12]}): extracting it again would keep both versions, every unchanged record twice; "
            f"pass --replace-changed-inputs to drop its old {plural(len(shards), 'shard')} "
            f"({format_ranges(shards) or 'none'}) and extract it again, or restore the file, or use another --out")


def plan_shards(files: list[InputFile], registrations: list[InputRegistration]) -> list[PlannedShard]:
    """Every shard of ``files`` (each file once, in order), given the store's registrations."""
    by_hash = {r.sha256: r for r in registrations}
    shards: list[PlannedShard] = []
    seen: set[str] = set()
    for f in files:
        if f.sha256 in seen:
            continue
        seen.add(f.sha256)
        reg = by_hash[f.sha256]
        for offset, (first, end) in enumerate(record_ranges(reg.num_records, reg.records_per_shard)):
            shards.append(PlannedShard(index=reg.first_shard + offset, input_path=f.path,
                                       input_name=reg.name, first_record=first, end_record=end))
    return shards


def shards_of_worker(shards: list[PlannedShard], shard_index: int, num_shards: int) -> list[PlannedShard]:
    """Worker ``shard_index`` of ``num_shards`` takes every global shard s with s % num_shards == shard_index."""
    assert 0 <= shard_index < num_shards
    return [s for s in shards if s.index % num_shards == shard_index]


# --------------------------------------------------------------------------------------------------
# The registry in the store (I/O)


def registration_path(root: str | os.PathLike, sha256: str) -> Path:
    """``STORE/inputs/<sha256>.json``: a registration's file is named by its sha256, so only a sha256
    may name one, inside the store (:mod:`peagle.pipeline.contained`)."""
    return inside(root, f"{S.INPUTS_DIR}/{checked_sha256(sha256, named_by=f'store {root}')}.json")


def read_registrations(root: str | os.PathLike) -> list[InputRegistration]:
    """The store's registered input files (none when the store does not exist yet).

    Raises:
        UserError: a registration is unreadable, or a name it gives is no sha256 or shard index (its
            ``sha256`` names its file, which ``--replace-changed-inputs`` deletes; its shard range names
            commit records and shard files).
    """
    regs = []
    for p in sorted((Path(root) / S.INPUTS_DIR).glob("[0-9a-f]*.json")):
        inside(root, f"{S.INPUTS_DIR}/{p.name}")  # a registration that is a link to elsewhere is not read
        try:
            reg = InputRegistration(**json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as err:
            raise UserError(f"input registration {p} is unreadable ({err})") from err
        checked_sha256(reg.sha256, named_by=f"input registration {p}")
        for field in ("first_shard", "end_shard"):
            checked_index(getattr(reg, field), named_by=f"input registration {p}", field=field)
        regs.append(reg)
    return sorted(regs, key=lambda r: r.first_shard)


def register_inputs(root: str | os.PathLike, files: list[InputFile],
                    records_per_shard: int) -> list[InputRegistration]:
    """Register ``files`` in the store (once, under the store lock); returns every registration.

    All files of one run are registered in one lock hold, so workers started with the same command
    agree on the ranges whichever of them comes first.

    Raises:
        UserError: a file's content changed since it was registered (``changed_inputs``; checked
            here, under the lock, as well as in the plan, so no race lets a second version in).
    """
    root = Path(root)
    (root / S.INPUTS_DIR).mkdir(parents=True, exist_ok=True)
    with file_lock(inside(root, S.STORE_LOCK_FILE)):
        existing = read_registrations(root)
        changed = changed_inputs(existing, files)
        if changed:
            raise UserError(changed_refusal(root, changed))
        new = assign_registrations(existing, files, records_per_shard)
        for reg in new:
            atomic_write_json(registration_path(root, reg.sha256), asdict(reg))
    return existing + new


def replace_registrations(root: str | os.PathLike, registrations: Iterable[InputRegistration]) -> None:
    """Make ``registrations`` the store's whole plan, removing any other; the caller holds the store
    lock. A first run records its plan so, before it publishes ``store.json`` (``init_store``): a
    store never exists without the plan of the run that made it."""
    root = Path(root)
    keep = {r.sha256: r for r in registrations}
    (root / S.INPUTS_DIR).mkdir(parents=True, exist_ok=True)
    for p in (root / S.INPUTS_DIR).glob("[0-9a-f]*.json"):
        if p.stem not in keep:
            inside(root, f"{S.INPUTS_DIR}/{p.name}").unlink()
    for reg in keep.values():
        atomic_write_json(registration_path(root, reg.sha256), asdict(reg))


def drop_registrations(root: str | os.PathLike, registrations: list[InputRegistration]) -> None:
    """Remove input files from the store: their shards' commit records, then their shard files, then
    their registrations, under the store lock; the manifest is derived again by the caller.

    The caller must be the store's only writer (``pipeline.store.WriterLock.alone``): a worker
    still extracting an old version would commit a shard of a file no longer in the plan. Killed
    half-way, it leaves the registration with some shards uncommitted (an incomplete store), and
    the same command drops the rest. The replacement may get the dropped indices again (it is
    registered after every remaining file): a shard file left behind is not committed, and the
    new one is renamed over it.
    """
    root = Path(root)
    with file_lock(inside(root, S.STORE_LOCK_FILE)):
        for reg in registrations:
            for shard in range(reg.first_shard, reg.end_shard):
                inside(root, S.commit_name(shard)).unlink(missing_ok=True)
            for shard in range(reg.first_shard, reg.end_shard):
                inside(root, S.parquet_name(shard)).unlink(missing_ok=True)
                inside(root, S.tensors_name(shard)).unlink(missing_ok=True)
            registration_path(root, reg.sha256).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------
# Completeness: the plan against the commit records


@dataclass(frozen=True, kw_only=True)
class Completeness:
    """How much of a store's plan is committed (module docstring)."""

    root: Path
    registrations: tuple[InputRegistration, ...]
    committed: frozenset[int]  # shard indices with a commit record

    @property
    def planned(self) -> list[int]:
        """Every shard the registered inputs make, ascending (a file of no records makes none)."""
        return sorted({s for r in self.registrations for s in range(r.first_shard, r.end_shard)})

    @property
    def missing(self) -> list[int]:
        return [s for s in self.planned if s not in self.committed]

    @property
    def num_committed(self) -> int:
        """Committed shards of the plan."""
        return len(self.planned) - len(self.missing)

    @property
    def recorded(self) -> bool:
        """Whether the store records a plan: stores from before registrations did not (nor does a
        store whose inputs all held zero records)."""
        return bool(self.registrations)

    @property
    def complete(self) -> bool:
        return not self.missing

    def registration_of(self, shard: int) -> InputRegistration:
        return next(r for r in self.registrations if r.first_shard <= shard < r.end_shard)

    def missing_records(self) -> int:
        return sum(end - first for first, end in (self.registration_of(s).records_of(s) for s in self.missing))

    def planned_records(self) -> int:
        return sum(r.num_records for r in self.registrations)

    def describe(self) -> str:
        """``1 of 2 shards committed (missing: shard 1, 10 of 20 planned records)``."""
        head = f"{self.num_committed} of {len(self.planned)} shards committed"
        if self.complete:
            return head
        return (f"{head} (missing: {plural(len(self.missing), 'shard')} {format_ranges(self.missing)}, "
                f"{self.missing_records():,} of {self.planned_records():,} planned records)")

    def refusal(self, verb: str) -> str:
        """The one line with which ``verb`` (vocab, train) refuses an incomplete store."""
        return (f"store {self.root} is incomplete: {self.describe()}; finish the extraction (`peagle store info "
                f"--store {self.root}` prints the command), or pass --allow-incomplete to {verb} on what is "
                "committed")

    def warning(self, verb: str) -> str:
        """What ``--allow-incomplete`` says: how much is missing."""
        share = self.missing_records() / max(self.planned_records(), 1)
        return (f"warning: store {self.root} is incomplete and --allow-incomplete was given: {verb} on "
                f"{self.describe()}, {share:.0%} of the planned records missing")


def store_completeness(root: str | os.PathLike, committed: Iterable[int]) -> Completeness:
    """The store's plan (its registrations) against ``committed`` (the indices of its commit records)."""
    return Completeness(root=Path(root), registrations=tuple(read_registrations(root)),
                        committed=frozenset(committed))


def usability_problem(root: str | os.PathLike, records: list[S.ShardRecord], commands: list[str] | None = None) -> str | None:
    """Why no reader can use a store whose files are intact, or None: nothing committed and no plan
    recorded (its first run stopped before registering its inputs: a store of an older peagle, which
    published ``store.json`` first), or every planned shard committed and none holding a usable
    sample (``ShardRecord.usable``: e.g. a chat template that failed on every record). The line ends
    with what to run: ``commands`` (``peagle store info`` and ``verify`` derive them from the plan),
    else where to find them.

    A store still being extracted (planned shards missing) is not judged here: it is incomplete,
    which readers refuse on their own unless told to go on, and ``train --follow`` waits for it.
    """
    root = Path(root)
    completeness = store_completeness(root, (r.index for r in records))
    if not records and not completeness.recorded:
        return (f"store {root} holds nothing: no shard committed and no plan recorded (the run that made it "
                "stopped before registering its inputs); run that `peagle extract` or `peagle store convert` "
                "command again")
    if records and completeness.complete and not any(r.usable for r in records):
        skipped: dict[str, int] = {}
        for r in records:
            for reason, n in r.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        why = ", ".join(f"{reason} {n:,}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
        return (f"store {root} holds no usable sample: its {len(records)} committed shards hold no sample with a "
                f"supervised token ({sum(r.num_records for r in records):,} records; skipped: {why or 'none'}); "
                "mend the cause and run its extract command again, which starts such a store afresh"
                + (f": {' ; '.join(commands)}" if commands else f" (`peagle store info --store {root}` prints it)"))
    return None


def format_ranges(indices: Iterable[int]) -> str:
    """``[1, 3, 4, 5, 9]`` -> ``"1, 3-5, 9"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"
