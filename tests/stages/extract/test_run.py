"""The extract driver in-process: plan and dry run, store conventions against transformers (docs/store.md, docs/indexing.md), refused re-runs, --strict, non-finite targets, --regenerate, appending data."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.store import open_store
from peagle.pipeline.shard_tensors import open_shard_tensors
from peagle.model.target.directory import open_target
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig
from peagle.stages.extract import run as R
from peagle.stages.extract import run_plan as RP
from peagle.testing.chat_data import chat_records, write_chat_jsonl


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("data") / "a.jsonl", 12, seed=0,
                            bad_lines={4: "{not json", 9: '{"messages": []}'})


def _config(data: Path, target: Path, out: Path, **kw) -> ExtractConfig:
    base = dict(data=(str(data),), target=str(target), out=str(out), backend="hf", samples_per_shard=5,
                device="cpu", threads=1)
    return ExtractConfig(**{**base, **kw})


def _quiet(config: ExtractConfig) -> R.ExtractSummary:
    lines: list[str] = []
    summary = R.run_extract(config, echo=lines.append, progress=False)
    summary.printed = "\n".join(lines)  # type: ignore[attr-defined]
    return summary


def test_dry_run_prints_the_plan_and_creates_nothing(data, tiny_llama, tmp_path):
    summary = _quiet(_config(data, tiny_llama, tmp_path / "s", dry_run=True))
    assert not (tmp_path / "s").exists()
    printed = summary.printed  # type: ignore[attr-defined]
    for words in ("12 records -> 3 shards", "3 to do", "tokens     ~", "960 bytes/token", "free disk"):
        assert words in printed, printed
    assert summary.plan.estimated_tokens > 0 and summary.records == []


def test_refuses_to_start_when_the_disk_cannot_hold_the_plan(data, tiny_llama, tmp_path):
    plan = _quiet(_config(data, tiny_llama, tmp_path / "s", dry_run=True)).plan
    RP.check_fits(plan, tmp_path)
    with pytest.raises(UserError, match="not enough disk .* needs ~.* is free"):
        RP.check_fits(replace(plan, free_bytes=plan.estimated_bytes - 1), tmp_path)


def test_token_estimate_from_a_sample_is_close(data, tiny_llama, tmp_path):
    plan = _quiet(_config(data, tiny_llama, tmp_path / "s", dry_run=True, samples_per_shard=2)).plan
    target = open_target(tiny_llama)
    exact, n, _, _ = RP.estimate_tokens(plan.pending, target.tokenizer, plan.settings, "all")
    sampled, m, _, _ = RP.estimate_tokens(plan.pending, target.tokenizer, plan.settings, "all", max_records=6)
    assert (exact, n) == (plan.estimated_tokens, 12) and m == 6
    assert 0.5 * exact < sampled < 1.5 * exact


def test_store_follows_design_and_index_conventions(data, tiny_qwen3, tmp_path):
    summary = _quiet(_config(data, tiny_qwen3, tmp_path / "s", aux_layers=(1, 3, 7), topk=8))
    store = open_store(tmp_path / "s", verify=True)
    assert [r.index for r in store.shards] == [0, 1, 2] == [r.index for r in summary.records]
    # where the time went, said before the last line
    assert 0 < summary.forward_seconds and 0 <= summary.writer_wait_seconds
    assert summary.forward_seconds + summary.writer_wait_seconds <= summary.work_seconds
    time_line = [ln for ln in summary.printed.splitlines() if ln.startswith("  time ")]  # type: ignore[attr-defined]
    assert len(time_line) == 1 and "target forward" in time_line[0] and "waiting for the shard writer" in time_line[0]
    manifest = json.loads((tmp_path / "s" / S.MANIFEST_FILE).read_text())
    assert manifest["aux_layer_ids"] == [1, 3, 7] and manifest["topk"] == 8
    assert manifest["target"]["architecture"] == "Qwen3ForCausalLM" and manifest["target"]["dtype"] == "float32"
    assert manifest["skipped"] == {"empty_conversation": 1, "malformed_json": 1}
    assert manifest["num_records"] == 12 and manifest["num_samples"] == 10
    assert (manifest["shards"][0]["input_file"], manifest["shards"][2]["first_record"]) == ("a.jsonl", 10)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    rows = read_shard_rows(store, 1).to_pylist()
    tensors = open_shard_tensors(store, 1)
    assert tensors[S.AUX_HIDDEN].shape == (sum(r["num_tokens"] for r in rows), 3, 128)
    for row in rows:
        ids, start, n = row["input_ids"], row["token_offset"], row["num_tokens"]
        assert len(ids) == n == len(row["loss_mask"]) and 0 < sum(row["loss_mask"]) < n
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        for a, layer in enumerate((1, 3, 7)):  # aux[i] = hidden_states[layer][i]
            ref = out.hidden_states[layer][0].to(torch.bfloat16).float()
            torch.testing.assert_close(tensors[S.AUX_HIDDEN][start:start + n, a].float(), ref, rtol=0, atol=3e-2)
        logprobs = torch.log_softmax(out.logits[0].float(), -1)  # logits[i] score x_{i+1}
        top = tensors[S.TOPK_IDS][start:start + n].long()
        assert (top[:, 0] == logprobs.argmax(-1)).float().mean() > 0.95
        torch.testing.assert_close(tensors[S.TOPK_LOGPROBS][start:start + n].float(), logprobs.gather(1, top),
                                   rtol=0, atol=2e-2)


@pytest.mark.parametrize("change, key", [
    (dict(aux_layers=(2, 3, 5)), "aux_layer_ids"),
    (dict(topk=16), "topk"),
    (dict(max_seq_len=1024), "max_seq_len"),
    (dict(loss_on="last"), "loss_on"),
])
def test_rerun_with_other_settings_is_refused_naming_both_values(data, tiny_llama, tmp_path, change, key):
    out, base = tmp_path / "s", dict(samples_per_shard=100, max_seq_len=64)
    _quiet(_config(data, tiny_llama, out, **base))
    before = sorted(p.name for p in (out / S.SHARDS_DIR).iterdir())
    with pytest.raises(UserError) as info:
        _quiet(_config(data, tiny_llama, out, **{**base, **change}))
    msg = str(info.value)
    assert f"{key}=" in msg and msg.count(f"{key}=") == 2 and "\n" not in msg
    assert sorted(p.name for p in (out / S.SHARDS_DIR).iterdir()) == before


def test_rerun_with_another_target_is_refused(data, tiny_llama, tiny_qwen3, tmp_path):
    _quiet(_config(data, tiny_llama, tmp_path / "s", samples_per_shard=100, max_seq_len=64))
    with pytest.raises(UserError, match=f"extracted from target {tiny_llama.resolve()} .*--target {tiny_qwen3.resolve()} "
                                        "has other weights"):
        _quiet(_config(data, tiny_qwen3, tmp_path / "s", samples_per_shard=100, max_seq_len=64))


def test_strict_names_file_and_line(data, tiny_llama, tmp_path):
    with pytest.raises(UserError, match=r"a.jsonl line 5: not valid JSON \(malformed_json\) \[--strict\]"):
        _quiet(_config(data, tiny_llama, tmp_path / "s", strict=True, samples_per_shard=2))
    # the shards before the bad record's shard were finished and committed; a fixed re-run goes on
    assert [r.index for r in open_store(tmp_path / "s").shards] == [0, 1]


def test_missing_target_and_data_are_one_line_errors(data, tiny_llama, tmp_path):
    with pytest.raises(UserError, match="target model directory .*nope does not exist"):
        _quiet(_config(data, tmp_path / "nope", tmp_path / "s"))
    with pytest.raises(UserError, match="data file .*missing.jsonl does not exist"):
        _quiet(_config(tmp_path / "missing.jsonl", tiny_llama, tmp_path / "s"))


def test_non_finite_target_samples_are_skipped_and_counted(tiny_llama, tmp_path):
    """A NaN embedding row poisons exactly the samples that contain that token."""
    target = tmp_path / "nan-target"
    shutil.copytree(tiny_llama, target)
    weights = load_file(str(target / "model.safetensors"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    records = chat_records(12, seed=5)
    token_sets = [set(tokenizer(tokenizer.apply_chat_template(r["messages"], tokenize=False),
                                add_special_tokens=False)["input_ids"]) for r in records]
    # a token that some records contain and others do not (the lowest such id: deterministic)
    token = min(t for t in set().union(*token_sets) if 3 <= sum(t in ts for ts in token_sets) <= 9)
    has = [token in ts for ts in token_sets]
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = _quiet(_config(data, target, tmp_path / "s", samples_per_shard=100))
    (record,) = summary.records
    assert record.skipped == {S.NON_FINITE_TARGET: sum(has)} and record.num_samples == 12 - sum(has)


def test_regenerate_replaces_assistant_turns_deterministically(tiny_llama, tmp_path):
    data = write_chat_jsonl(tmp_path / "r.jsonl", 4, seed=2)
    kw = dict(regenerate=True, max_new_tokens=6, temperature=0.8, seed=1, samples_per_shard=2, topk=4)
    for name in ("a", "b"):
        _quiet(_config(data, tiny_llama, tmp_path / name, **kw))
    for rel in (S.parquet_name(0), S.tensors_name(1), S.MANIFEST_FILE):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    plain = tmp_path / "plain"
    _quiet(_config(data, tiny_llama, plain, samples_per_shard=2, topk=4))
    regen_rows = pq.read_table(tmp_path / "a" / S.parquet_name(0)).to_pylist()
    plain_rows = pq.read_table(plain / S.parquet_name(0)).to_pylist()
    assert [r["source"] for r in regen_rows] == [r["source"] for r in plain_rows]
    for regen, orig in zip(regen_rows, plain_rows):
        assert regen["input_ids"] != orig["input_ids"] and sum(regen["loss_mask"]) > 0


def test_how_the_answers_were_written_is_part_of_the_store(tiny_llama, tmp_path):
    """The hf backend records the resolved generation dtype and batch size: a re-run that would write
    the answers differently (another batch, so other seeds; another dtype) is refused, not mixed in."""
    data = write_chat_jsonl(tmp_path / "r.jsonl", 4, seed=2)
    kw = dict(regenerate=True, max_new_tokens=4, temperature=0.0, samples_per_shard=2, topk=4,
              generation_dtype="float32", generation_batch_size=2)
    _quiet(_config(data, tiny_llama, tmp_path / "s", **kw))
    recorded = json.loads((tmp_path / "s" / S.STORE_SETTINGS_FILE).read_text())["regenerate"]
    assert recorded["generation_dtype"] == "float32" and recorded["generation_batch_size"] == 2
    with pytest.raises(UserError, match="generation_batch_size"):
        _quiet(_config(data, tiny_llama, tmp_path / "s", **{**kw, "generation_batch_size": 3}))
    with pytest.raises(UserError, match=r"regenerate.generation_dtype='float32', this run asks for .*'bfloat16'.* "
                                        r"\(--generation-dtype float32: the default became"):
        _quiet(_config(data, tiny_llama, tmp_path / "s", **{**kw, "generation_dtype": "bfloat16"}))


def test_the_answers_dtype_is_recorded_for_either_backend():
    """vLLM writes the answers in ``--generation-dtype`` too (its plain engine): the store records
    it whatever the backend; ``auto`` is bf16 for a float32 target on this CPU if it has native bf16."""
    from peagle.model.cpu_bf16 import cpu_has_native_bf16
    from peagle.stages.extract.store_settings import regeneration_settings

    base = dict(data=["x.jsonl"], target="t", out="o", regenerate=True, dtype="float32", device="cpu")
    auto = "bfloat16" if cpu_has_native_bf16() else "float32"
    for backend in ("hf", "vllm"):
        assert regeneration_settings(ExtractConfig(**base, backend=backend))["generation_dtype"] == auto
        pinned = ExtractConfig(**base, backend=backend, generation_dtype="float32")
        assert regeneration_settings(pinned)["generation_dtype"] == "float32"
        chosen = ExtractConfig(**base, backend=backend, generation_dtype="bfloat16")
        assert regeneration_settings(chosen)["generation_dtype"] == "bfloat16"
    assert "generation_batch_size" not in regeneration_settings(ExtractConfig(**base, backend="vllm"))


def test_regenerate_answers_prompt_only_records_and_says_each_round(tiny_llama, tmp_path):
    """Prompts alone are records for --regenerate: a conversation that ends with a user turn, or an
    empty assistant turn, gets the target's answer (without --regenerate both are skipped)."""
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(3)]
    rows.append({"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": ""},
                              {"role": "user", "content": "And?"}]})
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = _quiet(_config(data, tiny_llama, tmp_path / "s", regenerate=True, max_new_tokens=5, temperature=0.0,
                             topk=4, samples_per_shard=4))
    lines = summary.printed.splitlines()  # type: ignore[attr-defined]
    assert [ln.split(":")[0] for ln in lines if ln.startswith("regenerated")] == [
        "regenerated shard 0, round 1 of 2", "regenerated shard 0, round 2 of 2"]
    assert any(ln.startswith("regenerated shard 0, round 2 of 2: 1 answers, ") for ln in lines)
    rows_out = pq.read_table(tmp_path / "s" / S.parquet_name(0)).to_pylist()
    assert len(rows_out) == 4 and all(sum(r["loss_mask"]) > 0 for r in rows_out)


def test_appending_a_data_file_adds_shards_after_the_existing_ones(data, tiny_llama, tmp_path):
    out = tmp_path / "s"
    _quiet(_config(data, tiny_llama, out, topk=4))
    first = {p.name: p.read_bytes() for p in (out / S.SHARDS_DIR).iterdir()}
    more = write_chat_jsonl(tmp_path / "b.jsonl", 6, seed=9)
    summary = _quiet(replace(_config(data, tiny_llama, out, topk=4), data=(str(data), str(more))))
    assert [r.index for r in summary.records] == [3, 4]
    assert {p.name: p.read_bytes() for p in (out / S.SHARDS_DIR).iterdir() if p.name in first} == first
    assert [(r.index, r.input_file) for r in open_store(out).shards][-2:] == [(3, "b.jsonl"), (4, "b.jsonl")]
    again = _quiet(replace(_config(data, tiny_llama, out, topk=4), data=(str(more),)))
    assert again.records == [] and "0 to do" in again.printed  # type: ignore[attr-defined]


def test_a_changed_file_is_refused_or_replaced(tiny_llama, tmp_path):
    """An edited input would keep both versions (issue 37): refused naming it; with
    --replace-changed-inputs its old shards go and it is extracted again."""
    data = write_chat_jsonl(tmp_path / "a.jsonl", 4, seed=3)
    _quiet(_config(data, tiny_llama, tmp_path / "s", topk=4))
    write_chat_jsonl(data, 5, seed=3)  # edited in place: new content, same path
    for dry_run in (True, False):
        with pytest.raises(UserError, match=f"data file {data} changed since store .* registered it"):
            _quiet(_config(data, tiny_llama, tmp_path / "s", topk=4, dry_run=dry_run))
    printed = _quiet(_config(data, tiny_llama, tmp_path / "s", topk=4, replace_changed_inputs=True)).printed  # type: ignore[attr-defined]
    assert f"note: data file {data} changed since the store registered it: 1 old shard (0) dropped" in printed
    assert [(r.index, r.num_records) for r in open_store(tmp_path / "s").shards] == [(0, 5)]  # the index again
    other = shutil.copy(data, tmp_path / "b.jsonl")  # another file of the same content is the same file
    assert _quiet(_config(Path(other), tiny_llama, tmp_path / "s", topk=4)).records == []


def test_make_batches_is_fixed_and_bounded():
    lengths = [5, 40, 7, 40, 3, 12, 9]
    batches = R.make_batches(lengths, batch_size=3, max_batch_tokens=90)
    assert batches == R.make_batches(lengths, batch_size=3, max_batch_tokens=90)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and max(lengths[i] for i in b) * len(b) <= 90 or len(b) == 1
    assert batches[0] == [1, 3]  # longest first, ties by position; a third 40-token row would exceed 90
    assert R.make_batches([], 4, 100) == []


def test_a_store_without_a_mask_token_choice_is_not_extended(data, tiny_llama, tmp_path):
    store = tmp_path / "s"
    _quiet(_config(data, tiny_llama, store, samples_per_shard=6))
    settings = json.loads((store / "store.json").read_text())
    del settings["mask_token"], settings["mask_token_source"]
    (store / "store.json").write_text(json.dumps(settings))
    with pytest.raises(UserError, match="older peagle that recorded no mask token choice; extract into a new --out"):
        _quiet(_config(data, tiny_llama, store, samples_per_shard=6))


def test_explicit_mask_token_is_recorded_and_kept_out_of_the_data(data, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    [word] = tokenizer(" file", add_special_tokens=False)["input_ids"]  # a word of the chat data
    summary = _quiet(_config(data, tiny_llama, tmp_path / "s", mask_token_id=word))
    settings = summary.plan.settings
    assert (settings.mask_token_id, settings.mask_token, settings.mask_token_source) == (word, "Ġfile", "explicit")
    skipped = sum(r.skipped.get("contains_mask_token", 0) for r in summary.records)
    assert skipped > 0 and f"warning: {skipped} records contain the mask token {word}" in summary.printed
    assert "contain the mask token" in summary.printed.split("\n")[8]  # the plan said so before starting
    rows = [row for r in summary.records for row in pq.read_table(tmp_path / "s" / r.parquet).to_pylist()]
    assert rows and all(word not in row["input_ids"] for row in rows)
