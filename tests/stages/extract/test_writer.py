"""The shard writer: byte-identical output for identical input, non-finite samples dropped and counted,
and a writer thread that reports its errors (the Parquet file's columns: tests/pipeline/test_shard_parquet.py)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from peagle.pipeline import fp8
from peagle.pipeline.store import init_store, list_commits, open_store, sha256_file
from peagle.pipeline.shard_tensors import open_shard_tensors
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.model.target.backend import TargetOutput
from peagle.stages.extract.template import TokenizedSample
from peagle.stages.extract.writer import (
    ShardContent,
    ShardWriter,
    encoded_shard,
    write_and_commit,
)

A, H, K = 3, 16, 4
TARGET = S.TargetIdentity(path="/m", architecture="LlamaForCausalLM", num_hidden_layers=8, hidden_size=H,
                          vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t", chat_template_hash="h",
                           aux_layer_ids=(2, 4, 5), topk=K, max_seq_len=64, logprob_dtype="float16", loss_on="all")


def _sample(i: int, n: int) -> TokenizedSample:
    return TokenizedSample(sample_id=f"id{i}", source=f"a.jsonl:{i}", input_ids=list(range(i, i + n)),
                           loss_mask=[0] * (n // 2) + [1] * (n - n // 2))


def _output(i: int, n: int) -> TargetOutput:
    g = torch.Generator().manual_seed(i)
    return TargetOutput(aux_TAH=torch.randn(n, A, H, generator=g).to(torch.bfloat16),
                        topk_ids_TK=torch.randint(0, 64, (n, K), generator=g, dtype=torch.int32),
                        topk_logprobs_TK=-torch.rand(n, K, generator=g).sort(dim=-1).values * 5)


def _content(index: int = 0, lengths=(5, 3, 7)) -> ShardContent:
    return ShardContent(index=index, input_name="a.jsonl", first_record=0, end_record=len(lengths),
                        samples=[_sample(i, n) for i, n in enumerate(lengths)],
                        outputs=[_output(i, n) for i, n in enumerate(lengths)], skipped={"malformed_json": 1},
                        num_truncated=1, backend="hf")


def test_identical_input_gives_identical_bytes(tmp_path):
    for name in ("a", "b"):
        init_store(tmp_path / name, SETTINGS)
        write_and_commit(tmp_path / name, _content(), SETTINGS)
    for rel in (S.parquet_name(0), S.tensors_name(0), S.commit_name(0), S.MANIFEST_FILE):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_write_and_commit_records_sizes_hashes_and_counts(tmp_path):
    init_store(tmp_path, SETTINGS)
    record = write_and_commit(tmp_path, _content(index=3), SETTINGS)
    assert (record.index, record.num_samples, record.num_tokens, record.num_records) == (3, 3, 15, 3)
    assert record.parquet_sha256 == sha256_file(tmp_path / S.parquet_name(3))
    assert record.safetensors_bytes == os.path.getsize(tmp_path / S.tensors_name(3))
    assert record.skipped == {"malformed_json": 1} and record.num_truncated == 1 and record.backend == "hf"
    assert list_commits(tmp_path) == [record]
    store = open_store(tmp_path, verify=True)
    assert open_shard_tensors(store, 3)[S.AUX_HIDDEN].shape == (15, A, H)


def test_non_finite_samples_are_dropped_and_counted(tmp_path):
    content = _content()
    bad_aux = content.outputs[0].aux_TAH.clone()
    bad_aux[2, 1, 3] = float("nan")
    bad_lp = content.outputs[2].topk_logprobs_TK.clone()
    bad_lp[0, 0] = float("-inf")
    content.outputs[0] = TargetOutput(aux_TAH=bad_aux, topk_ids_TK=content.outputs[0].topk_ids_TK,
                                      topk_logprobs_TK=content.outputs[0].topk_logprobs_TK)
    content.outputs[2] = TargetOutput(aux_TAH=content.outputs[2].aux_TAH, topk_ids_TK=content.outputs[2].topk_ids_TK,
                                      topk_logprobs_TK=bad_lp)
    kept, encoded, stats = encoded_shard(content, SETTINGS)
    assert [s.sample_id for s in kept.samples] == ["id1"] and len(encoded) == 1 and stats.non_finite_rows == 0
    assert kept.skipped == {"malformed_json": 1, S.NON_FINITE_TARGET: 2}
    init_store(tmp_path, SETTINGS)
    record = write_and_commit(tmp_path, content, SETTINGS)
    assert record.num_samples == 1 and record.num_tokens == 3 and record.skipped[S.NON_FINITE_TARGET] == 2


def test_an_fp8_store_drops_non_finite_states_too():
    """fp8 encoding runs before the check now: NaN and inf must survive quantisation as non-finite rows."""
    content = _content()
    for i, value in ((0, float("nan")), (2, float("inf"))):
        aux = content.outputs[i].aux_TAH.clone()
        aux[1, 2, 0] = value
        content.outputs[i] = replace(content.outputs[i], aux_TAH=aux)
    kept, _, stats = encoded_shard(content, replace(SETTINGS, hidden_dtype=S.HIDDEN_FP8))
    assert [s.sample_id for s in kept.samples] == ["id1"] and kept.skipped[S.NON_FINITE_TARGET] == 2
    assert stats.non_finite_rows == 0


def test_states_that_only_overflow_when_stored_are_dropped_too():
    """A finite float32 state that rounds to inf in bf16 would be a non-finite row in the store, which
    `peagle train` refuses: the writer drops its sample. A finite log-prob below float16's range is
    stored clamped to it (zero probability either way) and kept."""
    content = _content()
    huge_aux = content.outputs[0].aux_TAH.float().clone()
    huge_aux[1, 0, 0] = 3.4e38  # finite in float32, past bf16's largest (3.39e38)
    tiny_lp = content.outputs[1].topk_logprobs_TK.float().clone()
    tiny_lp[0, -1] = -7e4  # finite in float32, past float16's lowest (-65504)
    content.outputs[0] = replace(content.outputs[0], aux_TAH=huge_aux)
    content.outputs[1] = replace(content.outputs[1], topk_logprobs_TK=tiny_lp)
    kept, encoded, stats = encoded_shard(content, SETTINGS)
    assert [s.sample_id for s in kept.samples] == ["id1", "id2"] and kept.skipped[S.NON_FINITE_TARGET] == 1
    assert stats.non_finite_rows == 0 and float(encoded[0][S.TOPK_LOGPROBS][0, -1]) == -65504.0


def test_shard_writer_commits_in_order_and_reraises_errors(tmp_path):
    init_store(tmp_path, SETTINGS)
    seen = []
    writer = ShardWriter(tmp_path, SETTINGS, on_commit=lambda r: seen.append(r.index))
    for i in range(4):
        writer.submit(_content(index=i))
    records = writer.close()
    assert [r.index for r in records] == seen == [0, 1, 2, 3]
    manifest = json.loads((tmp_path / S.MANIFEST_FILE).read_text())
    assert manifest["num_shards"] == 4

    broken = tmp_path / "not-a-store"
    broken.write_text("a file where the store's directory should be")
    writer = ShardWriter(broken, SETTINGS)
    writer.submit(_content(index=0))
    with pytest.raises((OSError, UserError)):
        writer.close()
    assert not Path(str(broken) + "/shards").exists()


# --------------------------------------------------------------------------------------------------
# The writer as extract runs it (threads, one torch thread each, rows in cache-sized chunks) writes the
# bytes the serial writer wrote before: whole-tensor fp8 conversions and norms, on the caller's thread.


def _old_quantize(states_TAH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize`` as it was: the whole tensor at once."""
    x = states_TAH.float()
    scale_TA = (x.abs().amax(dim=-1) / fp8.FP8_MAX).to(fp8.SCALE_DTYPE)
    divisor_TA = torch.where(scale_TA == 0, torch.ones_like(scale_TA), scale_TA)
    return (x / divisor_TA[..., None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE), scale_TA


def _old_dequantize(codes_TAH: torch.Tensor, scale_TA: torch.Tensor, dtype: torch.dtype = fp8.STATES_DTYPE):
    """``fp8.dequantize`` as it was: torch's own float8 conversion, the whole tensor at once."""
    return (codes_TAH.float() * scale_TA.float()[..., None]).to(dtype)


def _big_content(index: int) -> ShardContent:
    """Samples of several hundred (row, layer) states each, so that every chunked pass takes several
    chunks; one with a NaN (dropped), one with an all-zero state."""
    hidden, lengths = 64, (300, 129, 511, 90)
    samples, outputs = [], []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(100 + i)
        aux = torch.randn(n, A, hidden, generator=g) * torch.logspace(-2, 2, hidden)
        if i == 0:
            aux[7, 1] = 0.0
        if i == 3:
            aux[50, 0, 5] = float("nan")
        samples.append(_sample(i, n))
        outputs.append(TargetOutput(aux_TAH=aux.to(torch.bfloat16),
                                    topk_ids_TK=torch.randint(0, 64, (n, K), generator=g, dtype=torch.int32),
                                    topk_logprobs_TK=-torch.rand(n, K, generator=g).sort(dim=-1).values * 5))
    return ShardContent(index=index, input_name="a.jsonl", first_record=0, end_record=len(lengths), samples=samples,
                        outputs=outputs, backend="hf")


@pytest.mark.parametrize("hidden_dtype", [S.HIDDEN_BF16, S.HIDDEN_FP8])
def test_threaded_chunked_writer_writes_the_serial_writers_bytes(tmp_path, monkeypatch, hidden_dtype):
    settings = replace(SETTINGS, target=replace(TARGET, hidden_size=64), max_seq_len=1024, hidden_dtype=hidden_dtype)
    contents = [_big_content(i) for i in range(3)]
    new = tmp_path / "threaded"
    init_store(new, settings)
    writer = ShardWriter(new, settings, num_threads=2)  # as run_extract drives it
    for content in contents:
        writer.submit(content)
    records = writer.close()

    old = tmp_path / "serial"
    init_store(old, settings)
    with monkeypatch.context() as m:
        m.setattr(fp8, "quantize", _old_quantize)
        m.setattr(fp8, "dequantize", _old_dequantize)
        m.setattr(fp8, "chunk_rows", lambda: None)  # (norms: 4096 rows a pass, as before)
        old_records = [write_and_commit(old, content, settings) for content in contents]

    here = tmp_path / "caller"  # today's code on the caller's thread (torch's own thread count)
    init_store(here, settings)
    assert [write_and_commit(here, content, settings) for content in contents] == old_records

    assert records == old_records and all(r.skipped == {S.NON_FINITE_TARGET: 1} for r in records)
    assert [layer.zero_rows for layer in records[0].stats.layers] == [0, 1, 0]
    for i in range(3):
        for rel in (S.parquet_name(i), S.tensors_name(i), S.commit_name(i)):
            assert (new / rel).read_bytes() == (old / rel).read_bytes(), rel
    assert (new / S.MANIFEST_FILE).read_bytes() == (old / S.MANIFEST_FILE).read_bytes()


def test_writer_threads_use_one_torch_thread_and_leave_the_callers_count(tmp_path, monkeypatch):
    """The writer threads' torch ops run on one core each; the caller's count, and that of threads
    started after the writer, stay what they were."""
    import peagle.stages.extract.writer as writer_module

    seen = []

    def fake_write(root, content, settings):
        seen.append(torch.get_num_threads())
        return S.ShardRecord(index=content.index, parquet="p", safetensors="s", num_samples=0, num_tokens=0,
                             parquet_bytes=0, safetensors_bytes=0, parquet_sha256="", safetensors_sha256="",
                             input_file="a", first_record=0, end_record=0, num_records=0)

    monkeypatch.setattr(writer_module, "write_and_commit", fake_write)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        writer = ShardWriter(tmp_path, SETTINGS, num_threads=2)
        for i in range(4):
            writer.submit(_content(index=i))
        assert [r.index for r in writer.close()] == [0, 1, 2, 3]
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen == [1] * 4 and torch.get_num_threads() == 2 and later == [2]
    finally:
        torch.set_num_threads(before)
