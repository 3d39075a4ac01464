"""Extract planning: the split into shards is a pure function of the input, workers partition it,
and the store's input registry hands out shard ranges that concurrent workers agree on."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.pipeline import plan as P
from peagle.schemas.errors import UserError


def _file(name: str, n: int) -> P.InputFile:
    return P.InputFile(path=f"/data/{name}", sha256=name * 64, num_records=n)  # a sha256 has 64 hex digits


def test_record_ranges_cover_the_file_in_order():
    assert P.record_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert P.record_ranges(8, 4) == [(0, 4), (4, 8)]
    assert P.record_ranges(0, 4) == []
    assert P.num_shards_for(10, 4) == 3 and P.num_shards_for(0, 4) == 0


def test_files_get_consecutive_shard_ranges_in_the_order_given():
    regs = P.assign_registrations([], [_file("a", 10), _file("b", 3), _file("c", 0)], 4)
    assert [(r.name, r.first_shard, r.end_shard) for r in regs] == [("a", 0, 3), ("b", 3, 4), ("c", 4, 4)]
    shards = P.plan_shards([_file("a", 10), _file("b", 3)], regs)
    assert [(s.index, s.input_name, s.first_record, s.end_record) for s in shards] == [
        (0, "a", 0, 4), (1, "a", 4, 8), (2, "a", 8, 10), (3, "b", 0, 3)]


def test_appending_a_file_gives_new_shards_after_the_existing_ones():
    first = P.assign_registrations([], [_file("a", 10)], 4)
    new = P.assign_registrations(first, [_file("a", 10), _file("b", 5)], 4)
    assert [(r.name, r.first_shard, r.end_shard) for r in new] == [("b", 3, 5)]
    # the known file keeps its range; a run naming only the new file plans only its shards
    assert [s.index for s in P.plan_shards([_file("b", 5)], first + new)] == [3, 4]
    assert [s.index for s in P.plan_shards([_file("b", 5), _file("a", 10)], first + new)] == [3, 4, 0, 1, 2]


def test_a_known_file_with_another_records_per_shard_is_refused_naming_both_values():
    first = P.assign_registrations([], [_file("a", 10)], 4)
    with pytest.raises(UserError, match="samples_per_shard=4.*samples_per_shard=5"):
        P.assign_registrations(first, [_file("a", 10)], 5)


def test_the_same_content_twice_is_planned_once():
    regs = P.assign_registrations([], [_file("a", 5), _file("a", 5)], 2)
    assert len(regs) == 1
    assert [s.index for s in P.plan_shards([_file("a", 5), _file("a", 5)], regs)] == [0, 1, 2]


@settings(max_examples=60)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=5), per_shard=st.integers(1, 9),
       num_shards=st.integers(1, 6))
def test_workers_partition_the_shards_exactly(counts, per_shard, num_shards):
    files = [_file(chr(ord("a") + i), n) for i, n in enumerate(counts)]
    shards = P.plan_shards(files, P.assign_registrations([], files, per_shard))
    assert [s.index for s in shards] == list(range(len(shards)))
    for f in files:  # every record of every file in exactly one shard, in order
        mine = [s for s in shards if s.input_name == Path(f.path).name]
        assert [(s.first_record, s.end_record) for s in mine] == P.record_ranges(f.num_records, per_shard)
    parts = [P.shards_of_worker(shards, i, num_shards) for i in range(num_shards)]
    assert sorted(s.index for part in parts for s in part) == [s.index for s in shards]
    for i, part in enumerate(parts):
        assert all(s.index % num_shards == i for s in part)


def test_register_inputs_writes_the_registry_and_reuses_it(tmp_path):
    files = [_file("a", 10), _file("b", 3)]
    regs = P.register_inputs(tmp_path, files, 4)
    assert P.read_registrations(tmp_path) == regs
    stored = json.loads(P.registration_path(tmp_path, "a" * 64).read_text())
    assert stored == {"sha256": "a" * 64, "name": "a", "num_records": 10, "records_per_shard": 4,
                      "first_shard": 0, "end_shard": 3, "path": "/data/a"}
    assert P.register_inputs(tmp_path, files, 4) == regs  # idempotent
    more = P.register_inputs(tmp_path, [_file("c", 1)], 4)
    assert [(r.name, r.first_shard) for r in more] == [("a", 0), ("b", 3), ("c", 4)]


def _register(args) -> list[tuple[str, int, int]]:
    root, names = args
    regs = P.register_inputs(root, [_file(n, 7) for n in names], 3)
    return sorted((r.name, r.first_shard, r.end_shard) for r in regs)


def test_concurrent_registration_never_hands_out_overlapping_ranges(tmp_path):
    jobs = [(str(tmp_path), ["a", "b"]), (str(tmp_path), ["a", "b"]), (str(tmp_path), ["c"]),
            (str(tmp_path), ["d", "a"]), (str(tmp_path), ["a", "b"]), (str(tmp_path), ["c"])]
    with mp.get_context("fork").Pool(4) as pool:
        results = pool.map(_register, jobs)
    final = sorted((r.name, r.first_shard, r.end_shard) for r in P.read_registrations(tmp_path))
    assert len(final) == 4
    ranges = sorted((first, end) for _, first, end in final)
    assert all(a_end <= b_first for (_, a_end), (b_first, _) in zip(ranges, ranges[1:]))
    assert ranges[0][0] == 0 and ranges[-1][1] == 4 * 3  # contiguous: 4 files x 3 shards
    for names_result in results:  # every worker saw the final ranges of the files it asked for
        assert set(names_result) <= set(final)


def test_a_registration_written_before_paths_were_kept_still_reads(tmp_path):
    (tmp_path / "inputs").mkdir()
    P.registration_path(tmp_path, "a" * 64).write_text(json.dumps(
        {"sha256": "a" * 64, "name": "a", "num_records": 10, "records_per_shard": 4, "first_shard": 0, "end_shard": 3}))
    assert P.read_registrations(tmp_path)[0].path == ""


def test_completeness_is_the_plan_against_the_commit_records(tmp_path):
    """The registrations are the plan (per file and in all); missing = planned without a commit record."""
    P.register_inputs(tmp_path, [_file("a", 10), _file("b", 3), _file("c", 0)], 4)  # a: 0-2, b: 3, c: none
    two_workers_one_done = P.store_completeness(tmp_path, [0, 2])  # worker 0 of 2 finished, worker 1 died
    assert two_workers_one_done.planned == [0, 1, 2, 3]
    assert two_workers_one_done.missing == [1, 3] and two_workers_one_done.num_committed == 2
    assert not two_workers_one_done.complete and two_workers_one_done.recorded
    assert two_workers_one_done.missing_records() == 4 + 3 and two_workers_one_done.planned_records() == 13
    assert two_workers_one_done.describe() == ("2 of 4 shards committed (missing: shards 1, 3, 7 of 13 planned "
                                               "records)")
    refusal = two_workers_one_done.refusal("train")
    assert "incomplete" in refusal and "shards 1, 3" in refusal and "--allow-incomplete" in refusal
    assert "54% of the planned records missing" in two_workers_one_done.warning("training")
    assert P.store_completeness(tmp_path, [0, 1, 2, 3]).complete
    # a second extract of new inputs extends the plan: the store is incomplete again until they commit
    P.register_inputs(tmp_path, [_file("d", 5)], 4)
    extended = P.store_completeness(tmp_path, [0, 1, 2, 3])
    assert extended.missing == [4, 5] and extended.describe().startswith("4 of 6 shards committed")
    assert not P.store_completeness(tmp_path / "nothing", [0]).recorded  # a store from before registrations


def test_format_ranges():
    assert P.format_ranges([]) == ""
    assert P.format_ranges([5, 1, 3, 4, 9]) == "1, 3-5, 9"


def test_a_file_changed_since_its_registration_is_refused_and_can_be_dropped(tmp_path):
    """An edited file (same path, other sha256) would get new shards beside its old ones (issue 37):
    registering it is refused naming it; dropping the old version removes its commit records, shard
    files and registration, and the new content is registered after the remaining files."""
    from peagle.schemas import store as S

    a, b = _file("a", 10), _file("b", 3)
    P.register_inputs(tmp_path, [a, b], 4)  # a: 0-2, b: 3
    edited = P.InputFile(path=a.path, sha256="e" * 64, num_records=9)
    copy = P.InputFile(path="/elsewhere/a", sha256=a.sha256, num_records=10)  # the same content elsewhere
    assert P.changed_inputs(P.read_registrations(tmp_path), [copy, b]) == []
    [(changed, old)] = P.changed_inputs(P.read_registrations(tmp_path), [edited, b])
    assert changed == edited and [r.sha256 for r in old] == [a.sha256]
    with pytest.raises(UserError) as info:
        P.register_inputs(tmp_path, [edited], 4)
    assert str(info.value).startswith(f"data file /data/a changed since store {tmp_path} registered it")
    assert "old shards (0-2)" in str(info.value) and "--replace-changed-inputs" in str(info.value)
    for shard in range(4):
        for name in (S.commit_name(shard), S.parquet_name(shard), S.tensors_name(shard)):
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_text("x")
    P.drop_registrations(tmp_path, old)
    assert sorted(p.name for p in (tmp_path / S.COMMITS_DIR).iterdir()) == ["00003.json"]
    assert sorted(p.name for p in (tmp_path / S.SHARDS_DIR).iterdir()) == ["00003.parquet", "00003.safetensors"]
    regs = P.register_inputs(tmp_path, [edited, b], 4)
    assert sorted((r.sha256, r.first_shard, r.end_shard) for r in regs) == [(b.sha256, 3, 4), (edited.sha256, 4, 7)]
    # a registration from before paths were kept is matched by name
    (tmp_path / "old" / "inputs").mkdir(parents=True)
    P.registration_path(tmp_path / "old", "f" * 64).write_text(json.dumps(
        {"sha256": "f" * 64, "name": "c", "num_records": 1, "records_per_shard": 4, "first_shard": 0, "end_shard": 1}))
    assert len(P.changed_inputs(P.read_registrations(tmp_path / "old"), [_file("c", 2)])) == 1
