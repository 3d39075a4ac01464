"""Content checked on read (pipeline/store.py, docs/store.md): every shard file's crc32, per 64 MiB block,
is recorded at commit and compared with the bytes the first time a reader reads them, once per opened
store across the DataLoader workers forked from it; records from before the checksums read by size,
with one note."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import zlib

import pytest

from peagle.pipeline import content_check as CC
from peagle.pipeline import raw_reader as RR
from peagle.pipeline import store as ST
from peagle.pipeline.safetensors_file import read_header
from peagle.pipeline.shard_tensors import open_shard_tensors
from peagle.pipeline.store_reader import ShardReader, iter_shard_columns, iter_training_samples
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.testing.store_faults import flip_byte, recommit


def _block_crcs(data: bytes, block: int) -> tuple[str, ...]:
    return tuple(f"{zlib.crc32(data[i:i + block]):08x}" for i in range(0, max(len(data), 1), block))


def test_commit_records_the_crc32_of_each_block(raw_store, tmp_path, monkeypatch):
    for record in ST.open_store(raw_store.root).shards:
        for rel in (record.parquet, record.safetensors):
            assert record.crc32_of(rel) == _block_crcs((raw_store.root / rel).read_bytes(), S.CRC32_BLOCK_BYTES)
    old = S.ShardRecord.from_dict({k: v for k, v in record.to_dict().items() if not k.endswith("_crc32")})
    assert "parquet_crc32" not in old.to_dict()  # an older record serialises as before (manifest hash kept)
    assert S.ShardRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    data = bytes(range(256)) * 4096 * 3  # 3 MiB: 3 blocks of 1 MiB; and sizes at the edges
    monkeypatch.setattr(S, "CRC32_BLOCK_BYTES", 1 << 20)
    for size in (0, 1, 1 << 20, (1 << 20) + 1, len(data)):
        (tmp_path / "f").write_bytes(data[:size])
        sha, crcs = CC.file_digests(tmp_path / "f", chunk=1 << 18)
        assert crcs == _block_crcs(data[:size], 1 << 20), size


def test_a_block_is_summed_in_pieces_on_threads_and_combined(monkeypatch):
    """``block_crc32`` (pieces on the thread pool, combined) equals zlib's crc32 of the whole, also for
    a block that is not a whole number of pieces; ``crc32_combine`` equals zlib's for any lengths."""
    for n1, n2 in [(0, 5), (7, 0), (13, 1 << 17), (1 << 20, 1 << 22), (3, 100001)]:
        a, b = os.urandom(n1), os.urandom(n2)
        assert CC.crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b), (n1, n2)
    monkeypatch.setattr(CC, "PIECE_BYTES", 1000)
    data = memoryview(os.urandom(10_500))
    for cut in (0, 1, 999, 1000, 2000, 2001, 10_000, 10_500):
        assert CC.block_crc32(data[:cut]) == f"{zlib.crc32(data[:cut]):08x}", cut


def _changed_file_error(err: pytest.ExceptionInfo, root, record: S.ShardRecord, rel: str) -> None:
    message = str(err.value)
    assert "\n" not in message
    for needle in (f"store {root}", f"shard {S.shard_stem(record.index)}", rel, "peagle store verify",
                   str(root / S.commit_name(record.index))):
        assert needle in message, (needle, message)


def test_a_changed_parquet_byte_stops_its_first_read(raw_store):
    record = ST.open_store(raw_store.root).shards[1]
    flip_byte(raw_store.root / record.parquet)
    store = ST.open_store(raw_store.root)  # same size: opening passes
    with pytest.raises(UserError) as err:
        RR.read_raw_columns(store, record.index)
    _changed_file_error(err, raw_store.root, record, record.parquet)
    with pytest.raises(UserError, match="is not the file that was committed"):
        list(iter_shard_columns(store))  # what `peagle vocab` reads
    RR.read_raw_columns(store, store.shards[0].index)  # the others read as ever


def test_a_changed_tensor_byte_stops_its_first_map(raw_store):
    store = ST.open_store(raw_store.root)
    record = store.shards[2]
    flip_byte(raw_store.root / record.safetensors, at=0.6)  # in the aux rows
    with pytest.raises(UserError) as err:
        open_shard_tensors(store, record.index)
    _changed_file_error(err, raw_store.root, record, record.safetensors)
    reader = ShardReader([ST.open_store(raw_store.root)], capacity=2)
    with pytest.raises(UserError, match="is not the file that was committed"):
        reader.aux_read(0, 2, 0)  # the trainer reads these rows: checked before it is told where they are
    with pytest.raises(UserError, match="is not the file that was committed"):
        ShardReader([ST.open_store(raw_store.root)], capacity=2).sample(0, 2, 0)
    with pytest.raises(UserError, match="is not the file that was committed"):
        list(iter_training_samples(store))  # offline eval
    with pytest.raises(UserError, match="is not the file that was committed"):
        RR.open_raw_shard(store, record.index)  # store check, convert


def _open_in_child(store: ST.Store, index: int, queue) -> None:
    try:
        open_shard_tensors(store, index)
        queue.put("ok")
    except UserError as err:
        queue.put(str(err))


def test_workers_forked_from_an_opened_store_check_each_block_once(raw_store):
    """A forked process's pass counts for its parent and its siblings (DataLoader workers): a block
    checked is not checked again through that opened store, even if it changes later; a store opened
    anew checks again."""
    store = ST.open_store(raw_store.root)
    record = store.shards[0]
    context = mp.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_open_in_child, args=(store, record.index, queue))
    child.start()
    child.join(60)
    assert queue.get(timeout=5) == "ok" and child.exitcode == 0
    assert store.checks.passed(record.index, record.safetensors, 0)
    assert not store.checks.passed(record.index, record.parquet, 0)
    flip_byte(raw_store.root / record.safetensors, at=0.6)
    open_shard_tensors(store, record.index)  # passed once: not summed again
    with pytest.raises(UserError, match="is not the file that was committed"):
        open_shard_tensors(ST.open_store(raw_store.root), record.index)
    # and a forked child of a fresh store that finds the change says so
    queue = context.Queue()
    child = context.Process(target=_open_in_child, args=(ST.open_store(raw_store.root), record.index, queue))
    child.start()
    child.join(60)
    assert "is not the file that was committed" in queue.get(timeout=5)


def test_verify_counts_as_the_content_check(raw_store):
    store = ST.open_store(raw_store.root, verify=True)
    assert all(store.checks.passed(r.index, rel, 0) for r in store.shards for rel in (r.parquet, r.safetensors))


def test_the_training_reader_checks_the_blocks_it_reads(raw_store, monkeypatch):
    """With 64-byte blocks: handing out one sample checks the blocks of its rows, not the whole file; a
    change in a block that sample did not read stops the sample that reads it."""
    monkeypatch.setattr(S, "CRC32_BLOCK_BYTES", 64)
    index = ST.open_store(raw_store.root).shards[2].index  # samples of 12, 4, 2, 7 tokens
    record = recommit(raw_store.root, index)  # checksums of 64-byte blocks
    store = ST.open_store(raw_store.root)
    reader = ShardReader([store], capacity=2)
    reader.sample(0, 2, 1)
    reader.aux_read(0, 2, 1)
    passed = [store.checks.passed(index, record.safetensors, b) for b in range(len(record.safetensors_crc32))]
    assert 0 < sum(passed) < len(passed), passed
    path = raw_store.root / record.safetensors
    aux = read_header(path)[S.AUX_HIDDEN]
    offset = aux.offset + int(RR.read_raw_columns(store, index).token_offset[3]) * aux.row_bytes + 1
    assert not passed[offset // 64]
    flip_byte(path, at=offset / path.stat().st_size, mask=0x01)
    reader.sample(0, 2, 1)  # its blocks passed already
    with pytest.raises(UserError, match=f"bytes {offset // 64 * 64:,} to {offset // 64 * 64 + 64:,}"):
        reader.aux_read(0, 2, 3)
    with pytest.raises(UserError, match="is not the file that was committed"):
        reader.sample(0, 2, 3)


def test_verify_reports_a_record_whose_crc32_disagrees(raw_store):
    path = raw_store.root / S.commit_name(0)
    record = json.loads(path.read_text())
    record["parquet_crc32"] = "00000000"
    path.write_text(json.dumps(record))
    assert ST.check_shards(raw_store.root, ST.list_commits(raw_store.root)[:1], verify=True) == [
        f"{record['parquet']} crc32 does not match its commit record"]


def test_records_without_checksums_read_by_size_with_one_note(raw_store, caplog):
    for path in sorted((raw_store.root / S.COMMITS_DIR).glob("*.json")):
        record = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in record.items() if not k.endswith("_crc32")}))
    record = ST.list_commits(raw_store.root)[1]
    flip_byte(raw_store.root / record.parquet)
    flip_byte(raw_store.root / record.safetensors, at=0.6)
    ST._SAID_UNCHECKED.clear()
    with caplog.at_level(logging.WARNING, logger=ST.__name__):
        for _ in range(3):
            store = ST.open_store(raw_store.root)
            RR.read_raw_columns(store, record.index)  # not caught: there is nothing to compare with
            open_shard_tensors(store, record.index)
    notes = [r.getMessage() for r in caplog.records if "without content checksums" in r.getMessage()]
    assert len(notes) == 1, notes
    assert f"store {raw_store.root}: 3 of 3 shards" in notes[0] and "checked when read" in notes[0]
