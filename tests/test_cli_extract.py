"""`peagle extract` and `peagle store` end to end, as real subprocesses on the tiny Llama target:
the store layout of docs/store.md, n workers == 1 worker byte for byte, refused re-runs, one-line
errors, appending.

The baseline extraction runs the `peagle` console script in a fresh interpreter; the other commands
are children of the session's warm fork server (peagle/testing/warm_cli.py): each a real process
running the real entry point, without paying ~4 s of imports per command.

Kills, disk full, bad input and damage are the fault suite's (tests/faults, docs/reliability.md): resume after
kill -9 at every named failpoint, in turn and alone, and at random moments (test_fault_extract.py), a
file-size limit mid-run (test_fault_diskfull.py), --strict and an input of only bad lines
(test_fault_inputs.py), `store verify` of a damaged shard (test_fault_store.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from peagle.testing.warm_cli import Result
from peagle.schemas import extract_config as X
from peagle.schemas import store as S
from peagle.schemas.fields import field_docs
from peagle.testing.chat_data import write_chat_jsonl

COMMON = ("--samples-per-shard", "5", "--topk", "8", "--backend", "hf", "--device", "cpu", "--batch-size", "3")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    return {"a": write_chat_jsonl(d / "a.jsonl", 22, seed=0, bad_lines={6: "{oops", 13: '{"messages": "x"}'}),
            "b": write_chat_jsonl(d / "b.jsonl", 6, seed=1)}


def _args(data: dict[str, Path], target: Path, out: Path, *extra: str, files=("a",)) -> list[str]:
    return ["extract", *[a for f in files for a in ("--data", str(data[f]))], "--target", str(target),
            "--out", str(out), *COMMON, *extra]


def _ok(proc: subprocess.CompletedProcess | Result) -> subprocess.CompletedProcess | Result:
    assert proc.returncode == 0, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _one_line_error(proc: subprocess.CompletedProcess | Result, *needles: str) -> str:
    assert proc.returncode == 2, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    *progress, last = proc.stderr.strip().splitlines()  # progress lines of finished work may come first
    assert last.startswith("peagle: error: "), proc.stderr
    assert all(re.match(r"extract: \d+/\d+ rec \(\d+%\)", line) for line in progress), proc.stderr
    for needle in needles:
        assert needle in last, last
    return last


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file a reader may rely on (the lock file and store-level temp names excluded)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def baseline(data, tiny_llama, tmp_path_factory, cli_runner) -> Path:
    out = tmp_path_factory.mktemp("stores") / "base"
    proc = _ok(cli_runner.run(*_args(data, tiny_llama, out), cold=True))
    assert "peagle extract plan" in proc.stdout and "22 records -> 5 shards" in proc.stdout
    return out


def test_help_explains_every_config_field(run_peagle):
    import typer.main

    from peagle.cli import _register, app

    _register()
    command = typer.main.get_command(app).commands["extract"]
    flags = {p.name for p in command.params} - {"config", "more_data"}
    assert flags == set(field_docs(X.ExtractConfig))
    proc = _ok(run_peagle("extract", "--help"))
    for name in flags:
        assert f"--{name.replace('_', '-')}" in proc.stdout


def test_store_layout_matches_design(baseline, cli_runner):
    files = set(_snapshot(baseline))
    indices = [f"{i:05d}" for i in range(5)]
    expected = {S.MANIFEST_FILE, S.STORE_SETTINGS_FILE} | {f"shards/{i}.parquet" for i in indices} \
        | {f"shards/{i}.safetensors" for i in indices} | {f"commits/{i}.json" for i in indices}
    assert {f for f in files if not f.startswith("inputs/")} == expected
    assert len([f for f in files if f.startswith("inputs/")]) == 1
    manifest = json.loads((baseline / S.MANIFEST_FILE).read_text())
    assert set(manifest) == {"schema_version", "target", "tokenizer_fingerprint", "chat_template_hash",
                             "aux_layer_ids", "topk", "max_seq_len", "logprob_dtype", "loss_on", "mask_token_id", "mask_token",
                             "mask_token_source", "regenerate", "num_shards", "num_samples", "num_tokens", "num_records", "num_truncated",
                             "skipped", "shards"}
    assert manifest["aux_layer_ids"] == [2, 4, 5] and manifest["topk"] == 8 and manifest["num_records"] == 22
    assert manifest["skipped"] == {"malformed_json": 1, "messages_not_a_list": 1}
    assert set(manifest["shards"][0]) == {
        "index", "parquet", "safetensors", "num_samples", "num_tokens", "parquet_bytes", "safetensors_bytes",
        "parquet_sha256", "safetensors_sha256", "parquet_crc32", "safetensors_crc32", "input_file", "first_record", "end_record", "num_records",
        "skipped", "num_truncated", "backend", "stats", "token_counts", "num_supervised_turns"}
    stats = manifest["shards"][0]["stats"]  # content statistics, one entry per aux layer (peagle store check)
    assert len(stats["layers"]) == 3 and stats["layers"][0]["zero_rows"] == 0 and stats["topk"]["non_finite_rows"] == 0
    info = _ok(cli_runner.run("store", "info", "--store", baseline)).stdout
    assert "shards       5 of 5 committed (backend hf)" in info
    assert f"tokens       {manifest['num_tokens']:,}" in info and "malformed_json 1" in info
    assert "on disk vs 816 raw tensor bytes" in info
    assert "verify ok: 5 committed shards" in _ok(cli_runner.run("store", "verify", "--store", baseline)).stdout


def test_two_concurrent_workers_write_the_same_bytes_as_one(baseline, data, tiny_llama, tmp_path, cli_runner):
    out = tmp_path / "two"
    jobs = [cli_runner.start(*_args(data, tiny_llama, out, "--shard-index", str(i), "--num-shards", "2"))
            for i in (0, 1)]
    for job in jobs:
        _ok(job.wait(300))
    assert _snapshot(out) == _snapshot(baseline)


def test_rerun_skips_committed_shards(baseline, data, tiny_llama, cli_runner):
    """Nothing is rewritten: every file keeps its bytes (so `store info` and `store verify` say what
    test_store_layout_matches_design saw them say of these bytes) and the shards their mtimes."""
    before = _snapshot(baseline)
    mtimes = {p: p.stat().st_mtime_ns for p in (baseline / S.SHARDS_DIR).iterdir()}
    proc = _ok(cli_runner.run(*_args(data, tiny_llama, baseline)))
    assert "5 already committed, 0 to do" in proc.stdout and "nothing to do" in proc.stdout
    assert _snapshot(baseline) == before
    assert {p: p.stat().st_mtime_ns for p in (baseline / S.SHARDS_DIR).iterdir()} == mtimes


def test_rerun_with_other_settings_is_one_line_naming_both(baseline, data, tiny_llama, cli_runner):
    proc = cli_runner.run(*_args(data, tiny_llama, baseline, "--aux-layers", "1,4,5"))
    _one_line_error(proc, "aux_layer_ids=[2, 4, 5]", "aux_layer_ids=[1, 4, 5]")


def test_missing_model_dir_and_unreadable_data_are_one_line(data, tiny_llama, tmp_path, cli_runner):
    _one_line_error(cli_runner.run(*_args(data, tmp_path / "no-model", tmp_path / "s")), "no-model does not exist")
    (tmp_path / "dir.jsonl").mkdir()
    proc = cli_runner.run("extract", "--data", tmp_path / "dir.jsonl", "--target", tiny_llama, "--out", tmp_path / "s")
    _one_line_error(proc, "dir.jsonl is not a regular file")
    _one_line_error(cli_runner.run(*_args(data, tiny_llama, tmp_path / "s", "--aux-layers", "4,2")),
                    "strictly ascending")
    assert not (tmp_path / "s").exists()


def test_config_file_keys_are_the_flags(data, tiny_llama, tmp_path, cli_runner):
    cfg = tmp_path / "extract.yaml"
    cfg.write_text(f"data: [{data['b']}]\ntarget: {tiny_llama}\nout: {tmp_path / 's'}\naux-layers: 1,3,6\n"
                   "topk: 4\ndry_run: true\n")
    proc = _ok(cli_runner.run("extract", "--config", cfg, "--max-seq-len", "100"))
    assert "aux layers 1,3,6, top-k 4 (float16), max len 100" in proc.stdout
    assert not (tmp_path / "s").exists()
    cfg.write_text("topk_typo: 3\n")
    _one_line_error(cli_runner.run("extract", "--config", cfg), "unknown key 'topk_typo'")


def test_appending_a_data_file_adds_new_shards(baseline, data, tiny_llama, tmp_path, cli_runner):
    out = tmp_path / "appended"
    shutil.copytree(baseline, out)
    before = _snapshot(out)
    proc = _ok(cli_runner.run(*_args(data, tiny_llama, out, files=("a", "b"))))
    assert "5 already committed, 2 to do" in proc.stdout
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before and k != S.MANIFEST_FILE} == \
        {k: v for k, v in before.items() if k != S.MANIFEST_FILE}
    manifest = json.loads(after[S.MANIFEST_FILE])
    assert [(s["index"], s["input_file"]) for s in manifest["shards"]][-2:] == [(5, "b.jsonl"), (6, "b.jsonl")]


def test_the_plan_of_a_regeneration_bounds_the_answers_it_has_not_written(tiny_llama, tmp_path, cli_runner):
    """Prompt-only records (`--regenerate`) have no answer to count yet: the plan must not print
    ~0 tokens and ~0 B, but an upper bound (prompts + --max-new-tokens per answer, capped)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i} about rivers?"}]})
                               + "\n" for i in range(4)))
    proc = _ok(cli_runner.run("extract", "--data", prompts, "--target", tiny_llama, "--out", tmp_path / "s", *COMMON,
                          "--regenerate", "--max-new-tokens", "40", "--max-seq-len", "256", "--dry-run"))
    line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("tokens"))
    assert "at most: answers not written yet, up to 40 tokens each" in line, line
    tokens, supervised = (int(x.replace(",", "")) for x in re.findall(r"~([\d,]+)", line))
    assert supervised == 4 * 40 and 4 * 40 < tokens < 4 * 256, line
    assert "checked    4 records decoded: all usable" in proc.stdout  # prompts only are what --regenerate reads
    assert not (tmp_path / "s").exists()
    answers = next(ln for ln in proc.stdout.splitlines() if ln.startswith("  answers"))
    assert "written by the target, sampled at T 0.7, top-p 0.95, up to 40 tokens, in " in answers, answers
    greedy = _ok(cli_runner.run("extract", "--data", prompts, "--target", tiny_llama, "--out", tmp_path / "s", *COMMON,
                            "--regenerate", "--temperature", "0", "--generation-dtype", "bfloat16",
                            "--max-new-tokens", "40", "--max-seq-len", "256", "--dry-run", "--dtype", "float32"))
    assert "  answers    written by the target, greedy, up to 40 tokens, in bfloat16 (states in float32; " \
        "--generation-dtype)" in greedy.stdout, greedy.stdout
