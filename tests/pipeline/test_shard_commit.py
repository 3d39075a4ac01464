"""The one commit protocol (pipeline/shard_commit.py): both files in place and measured, then the record;
a failure or an interrupt between the two files leaves no file and no record; a shard whose tensors
alone are rewritten keeps its committed rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle.pipeline.shard_commit import write_and_commit_shard
from peagle.pipeline.store import init_store, list_commits, open_store, sha256_file
from peagle.schemas import store as S

TARGET = S.TargetIdentity(path="/m", architecture="LlamaForCausalLM", num_hidden_layers=8, hidden_size=16,
                          vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t", chat_template_hash="h",
                           aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=64, logprob_dtype="float16", loss_on="all")
RECORD = S.ShardRecord(index=2, parquet=S.parquet_name(2), safetensors=S.tensors_name(2), num_samples=1, num_tokens=4,
                       parquet_bytes=0, safetensors_bytes=0, parquet_sha256="", safetensors_sha256="",
                       input_file="a.jsonl", first_record=0, end_record=1, num_records=1)


def _writer(data: bytes):
    return lambda tmp: Path(tmp).write_bytes(data)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for d in (S.SHARDS_DIR, S.COMMITS_DIR) for p in (root / d).iterdir())


def test_a_shard_is_committed_with_the_measures_of_its_files(tmp_path):
    init_store(tmp_path, SETTINGS)
    record = write_and_commit_shard(tmp_path, RECORD, write_rows=_writer(b"rows"), write_tensors=_writer(b"tensors!"))
    assert (record.parquet_bytes, record.safetensors_bytes) == (4, 8)
    assert record.parquet_sha256 == sha256_file(tmp_path / S.parquet_name(2))
    assert record.safetensors_sha256 == sha256_file(tmp_path / S.tensors_name(2))
    assert len(record.parquet_crc32) == len(record.safetensors_crc32) == 1
    assert list_commits(tmp_path) == [record]
    open_store(tmp_path, verify=True)  # sizes, sha256 and crc32 all agree with the files


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, OSError])
def test_a_failure_between_the_two_files_leaves_no_file_and_no_record(tmp_path, error):
    """An interrupt (Ctrl-C's KeyboardInterrupt, a SystemExit) or an error while the tensor file is
    written, the Parquet file already renamed into place: both go, and the exception goes on up."""
    init_store(tmp_path, SETTINGS)

    def dies(tmp):
        Path(tmp).write_bytes(b"half a tensor file")
        assert (tmp_path / S.parquet_name(2)).exists()  # the first file is in place
        raise error()

    with pytest.raises(error):
        write_and_commit_shard(tmp_path, RECORD, write_rows=_writer(b"rows"), write_tensors=dies)
    assert _files(tmp_path) == [] and list_commits(tmp_path) == []


def test_a_failing_first_file_writes_nothing(tmp_path):
    init_store(tmp_path, SETTINGS)
    tensors_written = []

    def dies(tmp):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_and_commit_shard(tmp_path, RECORD, write_rows=dies, write_tensors=tensors_written.append)
    assert _files(tmp_path) == [] and tensors_written == []


def test_tensors_rewritten_alone_keep_the_committed_rows(tmp_path):
    init_store(tmp_path, SETTINGS)
    first = write_and_commit_shard(tmp_path, RECORD, write_rows=_writer(b"rows"), write_tensors=_writer(b"old"))
    again = write_and_commit_shard(tmp_path, first, write_rows=None, write_tensors=_writer(b"new tensors"))
    assert (again.parquet_bytes, again.parquet_sha256, again.parquet_crc32) == (
        first.parquet_bytes, first.parquet_sha256, first.parquet_crc32)
    assert again.safetensors_bytes == 11 and again.safetensors_sha256 != first.safetensors_sha256
    assert list_commits(tmp_path) == [again]
    open_store(tmp_path, verify=True)

    def dies(tmp):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the committed shard stays whole: its rows are not this call's
        write_and_commit_shard(tmp_path, again, write_rows=None, write_tensors=dies)
    assert list_commits(tmp_path) == [again]
    open_store(tmp_path, verify=True)
