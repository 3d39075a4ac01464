"""Content checked on read, by default (docs/store.md, docs/reliability.md; issue 37).

Before the checksums, the default read path checked file sizes only, so one changed byte in a
committed shard (a flipped exponent bit among the aux states, changed token ids) trained silently.
Now every shard file's crc32 (per 64 MiB block) is in its commit record and is compared with the bytes
the first time a reader reads them: `peagle train` (its DataLoader workers, for the tensors),
`peagle vocab`, `peagle store check` stop in one line naming the store, the shard and the file,
before a step uses it. A store committed before the checksums still reads (by size), with one note;
`peagle store convert` records checksums for what it writes.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

from faultkit import TRAIN_FLAGS, Result, ok, one_line_error, parallel_map
from peagle.pipeline.safetensors_file import read_header
from peagle.pipeline.store import open_store
from peagle.schemas import store as S
from peagle.schemas.loader_config import LoaderConfig
from peagle.schemas.train_config import StoreSpec
from peagle.stages.train.loader import TrainLoader
from peagle.testing.store_faults import flip_byte

AREA = "store content"
CHANGED = "is not the file that was committed"


def _copy(extract_baseline, tmp_path: Path, name: str) -> Path:
    store = tmp_path / name
    shutil.copytree(extract_baseline.store, store)
    return store


def _train(runner, extract_baseline, store: Path, *, workers: int = 0) -> Result:
    flags = list(TRAIN_FLAGS)
    flags[flags.index("--num-workers") + 1] = str(workers)
    return runner.run("train", "--store", store, "--target", extract_baseline.target, "--out",
                      store.parent / f"{store.name}-run-w{workers}", *flags)


def _first_batch_shard(store: Path) -> int:
    """The shard index of the first sample of the first batch `peagle train` with TRAIN_FLAGS builds (its
    plan: seed 3, token budget 640, world size 1)."""
    flag = dict(zip(TRAIN_FLAGS[::2], TRAIN_FLAGS[1::2]))
    loader = TrainLoader(LoaderConfig(stores=(StoreSpec(str(store)),), seed=int(flag["--seed"]),
                                      token_budget=int(flag["--token-budget"]), heldout_fraction=0.0))
    plan = loader.plan(0)
    first = plan.refs_of_rank[0][0]
    return loader.stores[0].shards[int(loader.index.shard_of[first])].index


def _flip_exponent_bit(path: Path) -> None:
    """The top exponent bit of one bf16 aux value in the middle of the file's aux rows (same size)."""
    entry = read_header(path)[S.AUX_HIDDEN]
    offset = entry.offset + (entry.nbytes // 2 | 1)  # little-endian bf16: the odd byte holds sign and exponent
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _names_the_file(res: Result, store: Path, index: int, rel: str) -> str:
    error = one_line_error(res, f"store {store}", f"shard {S.shard_stem(index)}", rel, CHANGED)
    assert "train:" not in res.stderr, f"a step ran before the damage was found:\n{res.describe()}"
    return error


def test_changed_bytes_stop_train_and_vocab_before_a_step(extract_baseline, runner, tmp_path, figures):
    """A flipped exponent bit in the aux rows of the shard the first batch reads stops `peagle train` (with
    and without DataLoader workers) before its first step; changed bytes in a Parquet file stop `peagle
    train` and `peagle vocab`; each in one line naming the store, the shard and the file."""
    tensors_store = _copy(extract_baseline, tmp_path, "tensors")
    index = _first_batch_shard(tensors_store)
    _flip_exponent_bit(tensors_store / S.tensors_name(index))
    rows_store = _copy(extract_baseline, tmp_path, "rows")
    flip_byte(rows_store / S.parquet_name(3))
    trials = [
        ("train, tensors", lambda: _train(runner, extract_baseline, tensors_store), tensors_store, index,
         S.tensors_name(index)),
        ("train with a worker, tensors", lambda: _train(runner, extract_baseline, tensors_store, workers=1),
         tensors_store, index, S.tensors_name(index)),
        ("train, rows", lambda: _train(runner, extract_baseline, rows_store), rows_store, 3, S.parquet_name(3)),
        ("vocab, rows", lambda: runner.run("vocab", "--store", rows_store, "--draft-vocab-size", "64"),
         rows_store, 3, S.parquet_name(3)),
        ("store check, tensors", lambda: runner.run("store", "check", "--store", tensors_store), tensors_store,
         index, S.tensors_name(index)),
    ]

    def trial(spec) -> str | None:
        name, run, store, shard, rel = spec
        res = run()
        try:
            _names_the_file(res, store, shard, rel)
        except AssertionError as err:
            return f"[{name}] {err}"
        return None

    problems = [p for p in parallel_map(trial, trials) if p]
    figures.add(trials=len(trials), faults_injected=len(trials), faults_survived=len(trials) - len(problems))
    assert not problems, "\n".join(problems)
    assert not list(tmp_path.glob("*-run-w*/checkpoints/step-*")), "a checkpoint was saved"


def test_vocab_reads_only_the_rows(extract_baseline, runner, tmp_path, figures):
    """`peagle vocab` never reads the tensor files (it counts tokens in the Parquet files), so changed aux
    rows do not stop it: they stop whatever reads them (`train`, `store check`, `eval`)."""
    store = _copy(extract_baseline, tmp_path, "vocab-tensors")
    _flip_exponent_bit(store / S.tensors_name(0))
    ok(runner.run("vocab", "--store", store, "--draft-vocab-size", "64"))
    figures.add(trials=1)


def test_convert_records_checksums(extract_baseline, runner, tmp_path, figures):
    """`peagle store convert` commits the crc32 of every file it writes, also from a store committed before
    checksums; a store without them reads by size, saying so once."""
    old = _copy(extract_baseline, tmp_path, "old")
    for path in sorted((old / S.COMMITS_DIR).glob("*.json")):
        record = json.loads(path.read_text())
        assert record["parquet_crc32"] and record["safetensors_crc32"]
        path.write_text(json.dumps({k: v for k, v in record.items() if not k.endswith("_crc32")}))
    res = ok(runner.run("vocab", "--store", old, "--draft-vocab-size", "64"))
    assert res.stderr.count("without content checksums") == 1, res.describe()
    assert f"store {old}: 8 of 8 shards were committed without content checksums" in res.stderr, res.describe()
    new = tmp_path / "fp8"
    ok(runner.run("store", "convert", "--store", old, "--hidden-dtype", "fp8", "--out", new))
    shards = open_store(new).shards
    assert len(shards) == 8
    block = S.CRC32_BLOCK_BYTES
    for record in shards:
        for rel in (record.parquet, record.safetensors):
            data = (new / rel).read_bytes()
            assert len(data) < block  # one block each
            assert record.crc32_of(rel) == (f"{zlib.crc32(data):08x}",), rel
    _flip_exponent_bit(new / S.tensors_name(5))
    res = runner.run("store", "check", "--store", new)
    one_line_error(res, f"store {new}", "shard 00005", S.tensors_name(5), CHANGED)
    figures.add(trials=2, faults_injected=1, faults_survived=1)
