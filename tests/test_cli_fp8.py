"""FP8 stores end to end through the real CLI: extract -> vocab -> train -> export -> eval (offline
chains on the fp8 store), and `peagle train` refusing a store whose commit statistics show zeroed
rows, in one line naming shard and flag. An fp8 store from the vLLM backend, trained on, exported
and served in vLLM, is tests/test_real_model.py's (on the real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.store import open_store
from peagle.testing import store_faults as F
from peagle.testing.chat_data import write_chat_jsonl


def ok(proc):
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def pipeline(run_peagle, root: Path, target: Path, backend: str, eval_mode: str) -> dict:
    """extract --hidden-dtype fp8 -> vocab -> train -> export -> eval; returns the eval report."""
    data = write_chat_jsonl(root / "chats.jsonl", 16, seed=7)
    store, run, export = root / "store", root / "run", root / "export"
    ok(run_peagle("extract", "--data", data, "--target", target, "--out", store, "--backend", backend,
                  "--hidden-dtype", "fp8", "--samples-per-shard", "8", "--max-seq-len", "256", "--topk", "8",
                  "--device", "cpu"))
    assert open_store(store).settings.hidden_dtype == "fp8"
    ok(run_peagle("vocab", "--store", store, "--draft-vocab-size", "256", "--quiet"))
    ok(run_peagle("train", "--store", store, "--target", target, "--out", run, "--max-steps", "4",
                  "--num-layers", "1", "--num-depths", "3", "--token-budget", "512", "--draft-vocab-size", "256",
                  "--heldout-fraction", "0.25", "--eval-every", "2", "--log-every", "1", "--num-workers", "1"))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["kind"] == "train"] == [1, 2, 3, 4]
    ok(run_peagle("export", run, "--out", export))
    ok(run_peagle("eval", export, "--target", target, "--store", store, "--mode", eval_mode, "--out", root / "report",
                  "--max-prompts", "2", "--max-new-tokens", "16", "--max-samples", "8", "--quiet"))
    return json.loads((root / "report" / "report.json").read_text())


@pytest.mark.slow
def test_fp8_store_from_the_hf_backend_trains_exports_and_evaluates(tiny_llama, tmp_path, run_peagle):
    report = pipeline(run_peagle, tmp_path, tiny_llama, "hf", "offline")
    offline = report["offline"]
    assert offline["num_chains"] > 0 and offline["acceptance_length"] >= 1.0

    # A buggy extractor's zeroed sample (its commit statistics say so): train refuses, naming shard and flag.
    store = tmp_path / "store"
    F.zero_sample_rows(store, 1, read_shard_rows(open_store(store), 1, ["sample_id"]).column("sample_id")[0].as_py())
    args = ("train", "--store", store, "--target", tiny_llama, "--out", tmp_path / "run2", "--max-steps", "1",
            "--num-layers", "1", "--num-depths", "3", "--token-budget", "512", "--draft-vocab-size", "256")
    refused = run_peagle(*args)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("peagle: error:")]
    assert refused.returncode == 2 and len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "shard 00001 holds broken rows" in errors[0] and "--allow-bad-aux-rows" in errors[0]
    ok(run_peagle(*args, "--allow-bad-aux-rows"))

