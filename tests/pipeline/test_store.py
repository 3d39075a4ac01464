"""The shard store's I/O (pipeline/store.py): settings, the commit protocol, the derived manifest,
concurrent committers, readers that see only committed shards, and size/sha256 checks."""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from peagle.pipeline import shard_commit as SC
from peagle.pipeline import store as ST
from peagle.schemas import store as S
from peagle.schemas.errors import UserError

TARGET = S.TargetIdentity(path="/models/t", architecture="LlamaForCausalLM", num_hidden_layers=8,
                          hidden_size=16, vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t" * 64, chat_template_hash="h" * 64,
                           aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=128, logprob_dtype="float16",
                           loss_on="all", mask_token_id=7)


def _write_shard(root: Path, index: int, num_tokens: int = 5) -> S.ShardRecord:
    """A small real shard: both files via write_shard_file, then the commit record."""
    tensors = {S.AUX_HIDDEN: torch.full((num_tokens, 3, 16), float(index), dtype=torch.bfloat16),
               S.TOPK_IDS: torch.arange(num_tokens * 4, dtype=torch.int32).view(num_tokens, 4),
               S.TOPK_LOGPROBS: torch.zeros(num_tokens, 4, dtype=torch.float16)}
    rows = SC.write_shard_file(root, S.parquet_name(index), lambda tmp: Path(tmp).write_bytes(f"rows of {index}".encode()))
    st = SC.write_shard_file(root, S.tensors_name(index), lambda tmp: save_file(tensors, str(tmp)))
    record = S.ShardRecord(index=index, parquet=S.parquet_name(index), safetensors=S.tensors_name(index),
                           num_samples=1, num_tokens=num_tokens, parquet_bytes=rows.size, safetensors_bytes=st.size,
                           parquet_sha256=rows.sha256, safetensors_sha256=st.sha256, parquet_crc32=rows.crc32,
                           safetensors_crc32=st.crc32, input_file="a.jsonl",
                           first_record=index, end_record=index + 1, num_records=1,
                           skipped={"malformed_json": index % 2}, backend="hf")
    SC.commit_shard(root, record)
    return record


def test_init_store_creates_layout_and_joins_with_equal_settings(tmp_path):
    root = ST.init_store(tmp_path / "s", SETTINGS)
    assert {p.name for p in root.iterdir()} >= {S.STORE_SETTINGS_FILE, S.COMMITS_DIR, S.SHARDS_DIR, S.INPUTS_DIR}
    assert ST.read_settings(root) == SETTINGS
    ST.init_store(root, SETTINGS)  # joining is fine


@pytest.mark.parametrize("change, key, old, new", [
    (dict(aux_layer_ids=(2, 4, 6)), "aux_layer_ids", "[2, 4, 5]", "[2, 4, 6]"),
    (dict(topk=8), "topk", "4", "8"),
    (dict(max_seq_len=64), "max_seq_len", "128", "64"),
    (dict(target=replace(TARGET, hidden_size=32)), "target.hidden_size", "16", "32"),
])
def test_init_store_with_other_settings_names_both_values(tmp_path, change, key, old, new):
    ST.init_store(tmp_path, SETTINGS)
    with pytest.raises(UserError) as info:
        ST.init_store(tmp_path, replace(SETTINGS, **change))
    msg = str(info.value)
    assert f"{key}={old}" in msg and f"{key}={new}" in msg and "\n" not in msg


def test_another_schema_version_is_refused(tmp_path):
    ST.init_store(tmp_path, SETTINGS)
    d = json.loads((tmp_path / S.STORE_SETTINGS_FILE).read_text())
    d["schema_version"] = 99
    (tmp_path / S.STORE_SETTINGS_FILE).write_text(json.dumps(d))
    with pytest.raises(UserError, match="schema_version 99.*schema_version 1"):
        ST.open_store(tmp_path)


def test_commit_protocol_and_derived_manifest(tmp_path):
    ST.init_store(tmp_path, SETTINGS)
    records = [_write_shard(tmp_path, i, num_tokens=3 + i) for i in (2, 0, 1)]
    manifest = json.loads((tmp_path / S.MANIFEST_FILE).read_text())
    assert [s["index"] for s in manifest["shards"]] == [0, 1, 2]
    assert manifest["num_tokens"] == 3 + 4 + 5 and manifest["num_samples"] == 3 and manifest["num_shards"] == 3
    assert manifest["skipped"] == {"malformed_json": 1}
    assert manifest["aux_layer_ids"] == [2, 4, 5] and manifest["schema_version"] == S.SCHEMA_VERSION
    assert manifest["target"]["hidden_size"] == 16
    assert sorted(ST.list_commits(tmp_path), key=lambda r: r.index) == sorted(records, key=lambda r: r.index)
    # canonical: derived again from the same commit records, the bytes are identical
    before = (tmp_path / S.MANIFEST_FILE).read_bytes()
    ST.rebuild_manifest(tmp_path)
    assert (tmp_path / S.MANIFEST_FILE).read_bytes() == before
    assert ST.manifest_hash(tmp_path) == ST.manifest_hash(tmp_path)
    assert not any(".tmp-" in p.name for p in tmp_path.rglob("*"))


def test_manifest_does_not_depend_on_commit_order(tmp_path):
    for name, order in (("a", [0, 1, 2]), ("b", [2, 1, 0])):
        ST.init_store(tmp_path / name, SETTINGS)
        for i in order:
            _write_shard(tmp_path / name, i)
    assert (tmp_path / "a" / S.MANIFEST_FILE).read_bytes() == (tmp_path / "b" / S.MANIFEST_FILE).read_bytes()


def _commit_many(args) -> None:
    root, indices = args
    for i in indices:
        _write_shard(Path(root), i)


def test_concurrent_committers_never_lose_a_manifest_update(tmp_path):
    ST.init_store(tmp_path, SETTINGS)
    with mp.get_context("fork").Pool(4) as pool:
        pool.map(_commit_many, [(str(tmp_path), range(w, 24, 4)) for w in range(4)])
    manifest = json.loads((tmp_path / S.MANIFEST_FILE).read_text())
    assert [s["index"] for s in manifest["shards"]] == list(range(24))
    assert ST.open_store(tmp_path, verify=True).num_samples == 24


def test_readers_see_only_committed_shards(tmp_path):
    ST.init_store(tmp_path, SETTINGS)
    _write_shard(tmp_path, 0)
    # shard 1's files are in place, but its commit record was never written (a crash)
    SC.write_shard_file(tmp_path, S.parquet_name(1), lambda tmp: Path(tmp).write_bytes(b"orphan"))
    SC.write_shard_file(tmp_path, S.tensors_name(1), lambda tmp: Path(tmp).write_bytes(b"orphan"))
    (tmp_path / S.COMMITS_DIR / ".00001.json.tmp-1-x").write_text("{half")  # a temp commit record
    store = ST.open_store(tmp_path, verify=True)
    assert [r.index for r in store.shards] == [0]
    with pytest.raises(KeyError):
        store.shard(1)


def test_size_and_sha256_checks(tmp_path):
    ST.init_store(tmp_path, SETTINGS)
    record = _write_shard(tmp_path, 0)
    path = tmp_path / record.parquet
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, other bytes
    ST.open_store(tmp_path)  # fast path: sizes only
    with pytest.raises(UserError, match="sha256 does not match"):
        ST.open_store(tmp_path, verify=True)
    path.write_bytes(data + b"x")
    with pytest.raises(UserError, match=f"{record.parquet} has {len(data) + 1} bytes"):
        ST.open_store(tmp_path)
    path.unlink()
    assert ST.check_shards(tmp_path, [record], verify=False) == [f"{record.parquet} is missing"]


def test_unreadable_commit_record_is_a_one_line_error(tmp_path):
    ST.init_store(tmp_path, SETTINGS)
    (tmp_path / S.commit_name(3)).write_text("{not json")
    with pytest.raises(UserError, match="00003.json is unreadable"):
        ST.list_commits(tmp_path)


def test_open_store_of_a_missing_or_foreign_directory(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ST.open_store(tmp_path / "nope")
    with pytest.raises(UserError, match="is not a peagle store"):
        ST.open_store(tmp_path)


def test_write_shard_file_discards_its_temp_on_failure(tmp_path):
    ST.init_store(tmp_path, SETTINGS)

    def failing(tmp):
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        SC.write_shard_file(tmp_path, S.parquet_name(0), failing)
    assert list((tmp_path / S.SHARDS_DIR).iterdir()) == []


def test_the_same_target_at_another_path_joins_a_store(tmp_path):
    """A target is known by its content hash (issue 37); other weights are named with both paths."""
    ST.init_store(tmp_path, SETTINGS)
    ST.init_store(tmp_path, replace(SETTINGS, target=replace(TARGET, path="/elsewhere/t")))
    assert ST.read_settings(tmp_path).target.path == "/models/t"  # the first path stays
    with pytest.raises(UserError) as info:
        ST.init_store(tmp_path, replace(SETTINGS, target=replace(TARGET, path="/other", content_hash="d" * 64)))
    assert str(info.value).startswith(f"store {tmp_path} was extracted from target /models/t (content hash cccc")
    assert "--target /other has other weights or config (content hash dddd" in str(info.value)


def test_only_an_unused_store_without_other_writers_is_restarted(tmp_path):
    """A store whose first run stopped before its first commit is started afresh by the next one
    (its registrations and manifest gone, store.json rewritten); not while another writer holds the
    writer lock, and never once a shard is committed."""
    other = replace(SETTINGS, topk=8)
    ST.init_store(tmp_path, SETTINGS)
    (tmp_path / S.INPUTS_DIR / ("a" * 64 + ".json")).write_text("{}")
    (tmp_path / S.MANIFEST_FILE).write_text("{}")
    with ST.WriterLock(tmp_path) as live, ST.WriterLock(tmp_path) as mine:
        with pytest.raises(UserError, match="topk=4"):  # another writer is live
            ST.init_store(tmp_path, other, writers=mine, restart=True)
        live.__exit__()
        ST.init_store(tmp_path, other, writers=mine, restart=True)
    assert ST.read_settings(tmp_path) == other
    assert (tmp_path / S.STORE_SETTINGS_FILE).read_bytes() == (ST.init_store(tmp_path / "fresh", other)
                                                              / S.STORE_SETTINGS_FILE).read_bytes()
    assert not list((tmp_path / S.INPUTS_DIR).glob("*.json")) and not (tmp_path / S.MANIFEST_FILE).exists()
    _write_shard(tmp_path, 0)
    with ST.WriterLock(tmp_path) as mine, pytest.raises(UserError, match="topk=8"):
        ST.init_store(tmp_path, SETTINGS, writers=mine, restart=True)
    assert ST.read_settings(tmp_path) == other
    with pytest.raises(UserError, match="topk=8"):  # without the writer lock: never restarted
        ST.init_store(tmp_path / "fresh", SETTINGS, restart=True)


def test_a_new_store_has_its_plan_before_its_settings(tmp_path):
    """``init_store(plan=...)`` records the plan before ``store.json``, replacing what a killed first run
    left; a directory with a plan and no ``store.json`` is no store to any reader."""
    from peagle.pipeline.plan import InputRegistration, read_registrations

    reg = InputRegistration(sha256="b" * 64, name="a.jsonl", num_records=3, records_per_shard=2, first_shard=0,
                            end_shard=2, path="/data/a.jsonl")
    stale = tmp_path / S.INPUTS_DIR / ("c" * 64 + ".json")
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")  # a killed first run's plan, of other inputs
    with pytest.raises(UserError, match="is not a peagle store"):
        ST.open_store(tmp_path)
    ST.init_store(tmp_path, SETTINGS, plan=[reg])
    assert read_registrations(tmp_path) == [reg] and ST.read_settings(tmp_path) == SETTINGS
    ST.init_store(tmp_path, SETTINGS, plan=[])  # joining leaves the plan alone
    assert read_registrations(tmp_path) == [reg]


def _empty_shard(root: Path, index: int) -> S.ShardRecord:
    """A committed shard whose records were all skipped (a chat template failing on each)."""
    record = replace(_write_shard(root, index), num_samples=0, num_tokens=0, skipped={"template_error": 4},
                     num_records=4)
    SC.commit_shard(root, record)
    return record


def test_a_store_without_a_usable_sample_is_refused_and_restarted(tmp_path):
    """Every planned shard committed and none usable, or neither plan nor shard: ``open_store`` refuses
    in one line; ``init_store(restart=True)`` with other settings starts it afresh (commit records and
    shard files gone), as it never does once a shard is usable."""
    from peagle.pipeline.plan import InputRegistration

    ST.init_store(tmp_path / "bare", SETTINGS)
    with pytest.raises(UserError, match="holds nothing: no shard committed and no plan recorded"):
        ST.open_store(tmp_path / "bare")
    reg = InputRegistration(sha256="b" * 64, name="a.jsonl", num_records=8, records_per_shard=4, first_shard=0,
                            end_shard=2, path="/data/a.jsonl")
    root = ST.init_store(tmp_path / "s", SETTINGS, plan=[reg])
    records = [_empty_shard(root, 0), _empty_shard(root, 1)]
    assert not any(r.usable for r in records) and _write_shard(ST.init_store(tmp_path / "other", SETTINGS), 0).usable
    with pytest.raises(UserError, match=r"holds no usable sample: its 2 committed shards .*template_error 8"):
        ST.open_store(root)
    other = replace(SETTINGS, chat_template_hash="m" * 64)
    with ST.WriterLock(root) as mine:
        ST.init_store(root, other, writers=mine, restart=True, plan=[reg])
    assert ST.read_settings(root) == other and not ST.list_commits(root)
    assert not list((root / S.SHARDS_DIR).iterdir())
    _write_shard(root, 0)
    with ST.WriterLock(root) as mine, pytest.raises(UserError, match="chat_template_hash"):
        ST.init_store(root, SETTINGS, writers=mine, restart=True, plan=[reg])
