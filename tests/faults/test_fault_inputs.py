"""Malformed input records through `peagle extract` (docs/reliability.md; issue 6): zero tracebacks, every bad
record skipped and counted under its reason in the manifest, and no good record lost or altered.

The bad records come from ``peagle.testing.bad_records`` (>= 200, each with its expected reason).
They are shuffled among good records; the good-only twin of the file (bad lines blanked, so every
good record keeps its line number and sample_id) is extracted too, and both stores must hold the same
samples bit for bit: same shard files, same sample_ids, input_ids, loss masks and tensors.

Bad input is loud where it must be: ``--strict`` ends the job at the first bad record, and an input of
nothing but bad lines (or more bad records than ``--max-skipped-share``) fails the dry run, the real
run, `peagle vocab` and `peagle store check`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from faultkit import EXTRACT_FLAGS, ok, one_line_error
from peagle.stages.extract.conversation import SKIP_REASONS
from peagle.stages.extract.readers import SourceRecord, decode_jsonl_line
from peagle.stages.extract.template import prepare_record
from peagle.testing.bad_records import ANY, bad_records, write_mixed_jsonl
from peagle.testing.chat_data import chat_records

AREA = "bad inputs"
FLAGS = ("--samples-per-shard", "64", "--topk", "8", "--backend", "hf", "--device", "cpu", "--batch-size", "8",
         "--max-seq-len", "256", "--threads", "1",
         "--max-skipped-share", "1")  # the catalogue outnumbers the good records: skipping is the point here


def good_records() -> list[dict]:
    """Plain chats plus valid records of unusual shape that must be kept as they are."""
    weird = [
        {"messages": [{"role": "user", "content": "Ünïcödé — 数据 🙂 \u2028 line sep"},
                      {"role": "assistant", "content": "Réponse: ✓ 🚀"}]},
        {"conversations": [{"from": "human", "value": "ShareGPT question?"}, {"from": "gpt", "value": "Answer."}],
         "system": "Be brief."},
        {"messages": [{"role": "user",
                       "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]},
                      {"role": "assistant", "content": "ok", "tool_calls": []}]},
        {"messages": [{"role": "user", "content": "hi", "name": "x", "extra": {"deep": [1, 2, {"z": None}]}},
                      {"role": "assistant", "content": "yo", "reasoning_content": "think"}], "id": 5, "meta": [None]},
        {"messages": [{"role": "user", "content": "{{ 7 * 7 }} {% if x %}jinja{% endif %}"},
                      {"role": "assistant", "content": "<|eot_id|> is text here </think>"}]},
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "empty prompt"}]},
        {"messages": [{"role": "user", "content": "call f"},
                      {"role": "assistant", "content": None,
                       "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                      {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]},
        {"messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a " * 400}]},  # truncated to max_seq_len, kept
    ]
    return chat_records(40, seed=11) + weird


def test_generator_is_deterministic_and_big_enough():
    records = bad_records()
    assert len(records) >= 200
    assert len({r.name for r in records}) == len(records)
    assert [r.line for r in records] == [r.line for r in bad_records()]
    assert {r.reason for r in records} - {ANY} <= set(SKIP_REASONS)
    assert len({r.reason for r in records}) >= 15  # covers most skip reasons
    assert all(b"\n" not in r.line for r in records)


@pytest.mark.parametrize("target", ["tiny_llama", "tiny_qwen3"])
def test_each_bad_record_gets_its_reason(target, request, figures):
    """Record by record, in process: the reader and the templating give exactly the expected reason."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(target))
    mask = tokenizer.convert_tokens_to_ids("<|mask|>")
    wrong = []
    records = bad_records()
    for i, rec in enumerate(records):
        raw, error = decode_jsonl_line(rec.line + b"\n")
        prepared = prepare_record(SourceRecord(Path("bad.jsonl"), i, raw, error), tokenizer, max_seq_len=256,
                                  mask_token_id=mask)
        got = prepared.skip_reason
        if got is None or got not in SKIP_REASONS or (rec.reason != ANY and got != rec.reason):
            wrong.append(f"{rec.name}: expected {rec.reason}, got {got} ({rec.line[:80]!r})")
    figures.add(trials=1, bad_inputs_tried=len(records), bad_inputs_handled=len(records) - len(wrong))
    assert not wrong, "\n".join(wrong)


def read_samples(store: Path) -> dict[str, dict]:
    """sample_id -> its row and the bytes of its tensor rows, straight from the files."""
    from safetensors import safe_open

    out = {}
    manifest = json.loads((store / "manifest.json").read_text())
    for shard in manifest["shards"]:
        rows = pq.read_table(store / shard["parquet"]).to_pylist()
        with safe_open(store / shard["safetensors"], framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for row in rows:
            a, n = row["token_offset"], row["num_tokens"]
            out[row["sample_id"]] = {**{k: row[k] for k in ("source", "input_ids", "loss_mask", "num_tokens")},
                                     **{k: t[a:a + n].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                        for k, t in tensors.items()}}
    return out


def is_deep(rec) -> bool:
    return rec.name.startswith("nested_junk/deep")


def extract_pair(runner, target: Path, root: Path, good: list[dict], bad) -> tuple[object, dict[str, Path]]:
    layout = write_mixed_jsonl(root / "data", good, bad, seed=5)
    stores = {}
    for kind, data in (("mixed", layout.mixed), ("good", layout.good_only)):
        stores[kind] = root / f"store-{kind}"
        ok(runner.run("extract", "--data", data, "--target", target, "--out", stores[kind], *FLAGS))
    return layout, stores


def test_bad_records_through_extract(extract_baseline, runner, tmp_path, figures):
    """Malformed records among good ones: each counted under its reason, good samples bit-identical.

    Every catalogue record but the deeply nested ones (see test_deeply_nested_json_is_skipped)."""
    bad = [r for r in bad_records() if not is_deep(r)]
    good = good_records()
    assert len(bad) >= 200
    _, stores = extract_pair(runner, extract_baseline.target, tmp_path, good, bad)
    figures.add(trials=1, bad_inputs_tried=len(bad))
    mixed = json.loads((stores["mixed"] / "manifest.json").read_text())
    twin = json.loads((stores["good"] / "manifest.json").read_text())

    # Every bad record counted under its reason; nothing else skipped.
    expected = Counter(r.reason for r in bad if r.reason != ANY)
    num_any = sum(r.reason == ANY for r in bad)
    skipped = Counter(mixed["skipped"])
    assert sum(skipped.values()) == len(bad), (skipped, len(bad))
    short = {r: (skipped[r], n) for r, n in expected.items() if skipped[r] < n}
    assert not short, f"reasons counted fewer times than expected (got, want): {short}"
    assert sum(skipped.values()) - sum(expected.values()) == num_any
    assert set(skipped) <= set(SKIP_REASONS)
    assert twin["skipped"] == {"blank_line": len(bad)}
    assert mixed["num_records"] == twin["num_records"] == len(good) + len(bad)
    figures.add(bad_inputs_handled=len(bad) - sum(short.values()) if short else len(bad))

    # No good record lost or altered: the same samples, bit for bit.
    got, want = read_samples(stores["mixed"]), read_samples(stores["good"])
    assert len(want) == len(good)
    lost = [sid for sid in want if got.get(sid) != want[sid]]
    figures.add(data_lost=len(lost) + len(set(got) - set(want)))
    assert not lost and set(got) == set(want)
    for shard in twin["shards"]:  # whole shard files, too
        for key in ("parquet", "safetensors"):
            assert (stores["mixed"] / shard[key]).read_bytes() == (stores["good"] / shard[key]).read_bytes()


def test_deeply_nested_json_is_skipped(extract_baseline, runner, tmp_path, figures):
    """JSON nested 900-1000 deep is skipped and counted, not a traceback.

    Such JSON parses, but whatever walks it next may hit Python's recursion limit: the record must
    still be skipped and counted, the job must not die."""
    bad = [r for r in bad_records() if is_deep(r)]
    figures.add(trials=1, bad_inputs_tried=len(bad))
    layout = write_mixed_jsonl(tmp_path / "data", chat_records(6, seed=3), bad, seed=6)
    store = tmp_path / "store"
    res = runner.run("extract", "--data", layout.mixed, "--target", extract_baseline.target, "--out", store, *FLAGS)
    ok(res)
    skipped = json.loads((store / "manifest.json").read_text())["skipped"]
    assert sum(skipped.values()) == len(bad), skipped
    figures.add(bad_inputs_handled=len(bad))


STRICT_PICKS = ("invalid_utf8/in_string", "truncated_json", "not_an_object", "unknown_role", "huge_user_turn/words",
                "bad_tools", "contains_mask_token")


def test_strict_fails_on_the_first_bad_record(extract_baseline, runner, tmp_path, figures):
    """--strict: the first bad record ends the job in one line naming file, line and reason."""
    by_prefix = {}
    for rec in bad_records():
        by_prefix.setdefault(rec.name.split("#")[0], rec)
    good_line = json.dumps(good_records()[0]).encode()
    failures = []
    for i, name in enumerate(STRICT_PICKS):
        rec = by_prefix[name]
        data = tmp_path / f"strict{i}.jsonl"
        data.write_bytes(good_line + b"\n" + rec.line + b"\n" + good_line + b"\n")
        res = runner.run("extract", "--data", data, "--target", extract_baseline.target, "--out",
                         tmp_path / f"store{i}", *FLAGS, "--strict")
        try:
            one_line_error(res, f"{data} line 2", "--strict", *(() if rec.reason == ANY else (rec.reason,)))
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    figures.add(trials=len(STRICT_PICKS), bad_inputs_tried=len(STRICT_PICKS),
                bad_inputs_handled=len(STRICT_PICKS) - len(failures))
    assert not failures, "\n".join(failures)


def loud(result, *needles: str) -> str:
    """``one_line_error``, and whatever came before the error is progress lines of finished work."""
    error = one_line_error(result, *needles)
    *progress, _ = result.stderr.strip().splitlines()
    assert all(re.match(r"extract: \d+/\d+ rec \(\d+%\)", line) for line in progress), result.describe()
    return error


def test_an_input_of_only_bad_lines_fails_everywhere(extract_baseline, runner, tmp_path):
    """An input of nothing but bad lines must not "succeed" anywhere (issue 22): not the dry run (it
    decodes every line it counts, and --strict applies to it), not the real run, not `peagle vocab` or
    `peagle store check` of what that committed; nor a share of bad records above --max-skipped-share."""
    bad = tmp_path / "allbad.jsonl"
    bad.write_text('{oops\n{"messages": "x"}\n')
    out = tmp_path / "s"
    args = ["extract", "--data", bad, "--target", extract_baseline.target, "--out", out, *EXTRACT_FLAGS]
    loud(runner.run(*args, "--dry-run", "--strict"), f"{bad} line 1: not valid JSON (malformed_json)", "[--strict]")
    line = loud(runner.run(*args, "--dry-run"), "the dry run found no usable record: all 2 were skipped")
    assert "1 not valid JSON" in line and f"first: {bad} line 1: not valid JSON" in line
    assert f"{bad} line 2: `messages` (or `conversations`) is not a list" in line
    assert not out.exists()
    line = loud(runner.run(*args), "extraction found no usable record", f"{bad} line 2")
    assert "{'" not in line  # in words, not a Python dict
    # what it committed (an empty shard) is refused downstream, naming what to run
    for command in (("vocab", "--store", out, "--draft-vocab-size", "10", "--quiet"), ("store", "check", "--store", out)):
        loud(runner.run(*command), f"store {out} holds no usable sample", "store info --store")
    # the baseline's input: 2 of its 30 lines are bad (lines 6 and 18: faultkit's BAD_LINES)
    line = loud(runner.run(*extract_baseline.args(tmp_path / "t", "--dry-run", "--max-skipped-share", "0.05")),
                "skipped 2 of 30 records (7%, more than --max-skipped-share 0.05)")
    data = extract_baseline.data
    assert f"{data} line 6: `messages` (or `conversations`) is not a list" in line, line
    assert f"{data} line 18: not valid JSON" in line, line
    ok(runner.run(*extract_baseline.args(tmp_path / "t", "--dry-run", "--max-skipped-share", "0.1")))


def test_a_record_larger_than_the_bound_is_skipped_undecoded(extract_baseline, runner, tmp_path, figures):
    """A record of more bytes than `--max-record-bytes` (a 5 MB one lifted extract's peak memory from
    ~0.5 to ~2.3 GB, a few hundred MB ended the process) is skipped and counted as too large, in the dry
    run and the real one, and the other records' samples are those of a run without it."""
    figures.add(trials=1, bad_inputs_tried=1)
    lines = extract_baseline.data.read_text().splitlines(keepends=True)
    giant = json.dumps({"messages": [{"role": "user", "content": "tell me " * 400_000},
                                     {"role": "assistant", "content": "no"}]}) + "\n"
    data = tmp_path / "with-giant.jsonl"
    data.write_text("".join(lines[:3] + [giant] + lines[3:]))
    args = ["extract", "--data", data, "--target", extract_baseline.target, "--out", tmp_path / "s", *EXTRACT_FLAGS,
            "--max-record-bytes", str(1 << 20)]
    dry = ok(runner.run(*args, "--dry-run"))
    assert "1 larger than --max-record-bytes" in dry.stdout, dry.stdout
    ok(runner.run(*args))
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["skipped"]["too_large"] == 1 and manifest["num_records"] == len(lines) + 1, manifest["skipped"]
    assert manifest["num_samples"] == extract_baseline.manifest["num_samples"]
    assert manifest["num_tokens"] == extract_baseline.manifest["num_tokens"]
    figures.add(bad_inputs_handled=1)
