"""`peagle store info` / `verify` on a store written by the real writer (no model needed)."""

from __future__ import annotations

import pytest
import torch

from peagle.pipeline.store import init_store
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.model.target.backend import TargetOutput
from peagle.stages.store.info import format_info, store_info, verify_store
from peagle.stages.extract.template import TokenizedSample
from peagle.stages.extract.writer import ShardContent, write_and_commit

TARGET = S.TargetIdentity(path="/m", architecture="LlamaForCausalLM", num_hidden_layers=8, hidden_size=16,
                          vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t", chat_template_hash="h",
                           aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=64, logprob_dtype="float16", loss_on="all")


def _content(index: int, lengths: tuple[int, ...]) -> ShardContent:
    samples = [TokenizedSample(sample_id=f"{index}-{i}", source=f"a.jsonl:{i}", input_ids=[1] * n,
                               loss_mask=[1] * n) for i, n in enumerate(lengths)]
    outputs = [TargetOutput(aux_TAH=torch.zeros(n, 3, 16, dtype=torch.bfloat16),
                            topk_ids_TK=torch.zeros(n, 4, dtype=torch.int32), topk_logprobs_TK=torch.zeros(n, 4))
               for n in lengths]
    return ShardContent(index=index, input_name="a.jsonl", first_record=0, end_record=len(lengths),
                        samples=samples, outputs=outputs, skipped={"malformed_json": 1}, num_truncated=1,
                        backend="hf")


@pytest.fixture
def store(tmp_path):
    init_store(tmp_path, SETTINGS)
    write_and_commit(tmp_path, _content(index=0, lengths=(5, 3)), SETTINGS)
    write_and_commit(tmp_path, _content(index=1, lengths=(7,)), SETTINGS)
    (tmp_path / S.SHARDS_DIR / "00002.parquet").write_bytes(b"uncommitted: invisible")
    return tmp_path


def test_info_counts_committed_shards_only(store):
    info = store_info(store)
    assert (info.num_shards, info.num_samples, info.num_tokens, info.num_records) == (2, 3, 15, 3)
    assert info.skipped == {"malformed_json": 2} and info.num_truncated == 2 and info.backends == ("hf",)
    assert info.raw_bytes_per_token == 3 * 16 * 2 + 4 * 6
    assert info.bytes_per_token > info.raw_bytes_per_token
    text = format_info(info)
    for words in ("shards       2 committed, no plan recorded", "(backend hf)", "tokens       15", "aux_layer_ids [2, 4, 5]",
                  "skipped      malformed_json 2", "raw tensor bytes",
                  # this fixture's aux rows are all zero, and its commit statistics say so
                  "rows         45 all-zero and 0 non-finite rows by the commit statistics of 2 of 2 shards"):
        assert words in text, text


def test_verify_finds_every_damaged_file(store):
    assert verify_store(store) == (2, [])
    path = store / S.tensors_name(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (store / S.parquet_name(0)).unlink()
    num_shards, problems = verify_store(store)
    assert num_shards == 2 and sorted(problems) == sorted(
        [f"{S.parquet_name(0)} is missing", f"{S.tensors_name(1)} sha256 does not match its commit record"])


def test_info_of_a_missing_store_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        store_info(tmp_path / "nope")
    with pytest.raises(UserError, match="not a peagle store"):
        verify_store(tmp_path)


def test_info_shows_the_mask_token_and_supervised_tokens_by_kind(tmp_path):
    settings = S.StoreSettings(**{**SETTINGS.__dict__, "mask_token_id": 60, "mask_token": "[control_768]",
                                  "mask_token_source": S.MASK_FROM_RESERVED})
    init_store(tmp_path, settings)
    content = _content(index=0, lengths=(5, 3))
    counts = [{"supervised.content": 2, "supervised.end_of_turn": 1, "unsupervised.user": 2},
              {"supervised.tool_call": 1, "supervised.end_of_turn": 1, "unsupervised.tool": 1}]
    content.samples = [TokenizedSample(**{**s.__dict__, "token_counts": c, "num_turns": 1})
                       for s, c in zip(content.samples, counts)]
    content.num_rendered_per_turn = 1
    record = write_and_commit(tmp_path, content, settings)
    assert record.token_counts == {"supervised.content": 2, "supervised.end_of_turn": 2, "supervised.tool_call": 1,
                                   "unsupervised.tool": 1, "unsupervised.user": 2}
    text = format_info(store_info(tmp_path))
    for words in ("mask token   60 [control_768] (a reserved special token the chat template never writes)",
                  "supervised   5 tokens (62.5%) in 2 assistant turns: content 2, reasoning 0, tool_call 1, "
                  "end_of_turn 2, outside_assistant 0",
                  "unsupervised user 2, tool 1", "1 records rendered turn by turn"):
        assert words in text, text


def test_a_store_from_an_older_peagle_still_reads(store):
    """No mask token choice and no token counts: info says so, and the manifest derives unchanged."""
    text = format_info(store_info(store))
    assert "mask token   none recorded" in text and "not counted by kind (store written by an older peagle)" in text
    assert verify_store(store) == (2, [])
    assert "mask_token_source" not in (store / S.STORE_SETTINGS_FILE).read_text()
