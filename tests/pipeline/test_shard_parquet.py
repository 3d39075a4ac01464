"""The shard Parquet file (pipeline/shard_parquet.py): exactly docs/store.md's columns and types, the same
bytes for the same rows, and a committed shard's rows read back, its content checked first."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peagle.pipeline.shard_commit import write_and_commit_shard
from peagle.pipeline.shard_parquet import parquet_table, read_shard_rows, write_parquet
from peagle.pipeline.store import init_store, open_store
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.testing.store_faults import flip_byte, recommit

TARGET = S.TargetIdentity(path="/m", architecture="LlamaForCausalLM", num_hidden_layers=8, hidden_size=16,
                          vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t", chat_template_hash="h",
                           aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=64, logprob_dtype="float16", loss_on="all")


@dataclass
class Row:
    """A ``ParquetSample`` that is not extract's (the file needs only these four fields)."""

    sample_id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


ROWS = [Row(f"id{i}", f"a.jsonl:{i}", list(range(i, i + n)), [0] * (n // 2) + [1] * (n - n // 2))
        for i, n in enumerate((5, 3, 7))]


def test_parquet_rows_follow_design_exactly(tmp_path):
    write_parquet(parquet_table(ROWS), tmp_path / "x.parquet")
    table = pq.read_table(tmp_path / "x.parquet")
    assert tuple(table.column_names) == S.PARQUET_COLUMNS
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.uint8())
    rows = table.to_pylist()
    assert [r["num_tokens"] for r in rows] == [5, 3, 7]
    assert [r["token_offset"] for r in rows] == [0, 5, 8]
    assert rows[1]["input_ids"] == [1, 2, 3] and rows[1]["loss_mask"] == [0, 1, 1]
    assert rows[2]["sample_id"] == "id2" and rows[2]["source"] == "a.jsonl:2"


def test_an_empty_shard(tmp_path):
    write_parquet(parquet_table([]), tmp_path / "e.parquet")
    assert pq.read_table(tmp_path / "e.parquet").num_rows == 0


def test_the_same_rows_give_the_same_bytes(tmp_path):
    for name in ("a", "b"):
        write_parquet(parquet_table(ROWS), tmp_path / name)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def _committed(root):
    """A store of one shard whose tensor file is a stand-in (only its Parquet file is read here)."""
    init_store(root, SETTINGS)
    record = S.ShardRecord(index=0, parquet=S.parquet_name(0), safetensors=S.tensors_name(0), num_samples=len(ROWS),
                           num_tokens=15, parquet_bytes=0, safetensors_bytes=0, parquet_sha256="",
                           safetensors_sha256="", input_file="a.jsonl", first_record=0, end_record=3, num_records=3)
    write_and_commit_shard(root, record, write_rows=lambda tmp: write_parquet(parquet_table(ROWS), tmp),
                           write_tensors=lambda tmp: tmp.write_bytes(b"tensors"))
    return root


def test_a_committed_shard_reads_back_whole_or_by_columns(tmp_path):
    store = open_store(_committed(tmp_path))
    assert read_shard_rows(store, 0).to_pylist() == pq.read_table(tmp_path / S.parquet_name(0)).to_pylist()
    table = read_shard_rows(store, 0, ["sample_id", "num_tokens"])
    assert table.column_names == ["sample_id", "num_tokens"]
    assert table.column("num_tokens").to_pylist() == [5, 3, 7]


def test_a_changed_or_unparsable_file_is_one_line(tmp_path):
    root = _committed(tmp_path)
    flip_byte(root / S.parquet_name(0))
    with pytest.raises(UserError, match="is not the file that was committed"):
        read_shard_rows(open_store(root), 0)
    (root / S.parquet_name(0)).write_bytes(b"no parquet here")
    recommit(root, 0)  # committed so: the checksums match, the file does not parse
    with pytest.raises(UserError, match="is damaged") as err:
        read_shard_rows(open_store(root), 0)
    assert "\n" not in str(err.value) and S.parquet_name(0) in str(err.value)
