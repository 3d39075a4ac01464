"""The whole pipeline on a real trained model, SmolLM2-135M-Instruct (`peagle target fetch smollm2`),
through the real CLI as the demo runs it: extract with vLLM regenerating the answers (the mask token
chosen with no flag), vocab, train, export, and vLLM serving the export with parallel drafting.

The draft trains a few steps only: what this proves is that a real tokenizer, template and model go
through every stage and reach vLLM intact, with greedy output unchanged. What a draft for it
accepts is measured by the demo and benchmarks/quality.py (README "Draft quality"). Our own loop
(``--mode online``) is not run here: it is the same code for every Llama-architecture target, and its
greedy output equal to plain decoding is tests/stages/eval/test_online.py's and
tests/stages/eval/test_run.py's (the command), its acceptance equal to vLLM's
tests/stages/eval/test_vllm_eval.py's and test_vllm_eagle3.py's (on SmolLM2 it cost ~15 s of CPU).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from peagle.stages.eval.vllm_eval import vllm_available
from peagle.testing.chat_prompts import chat_prompts

K = 5


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here")
def test_smollm2_extract_train_export_serve(smollm2_target, tmp_path, run_peagle):
    def ok(*args):
        proc = run_peagle(*args, timeout=1200)
        assert proc.returncode == 0, f"peagle {args[0]} failed:\n{proc.stderr[-3000:]}"
        return proc

    data, prompts = tmp_path / "chats.jsonl", tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": p.messages()}) + "\n" for p in chat_prompts(split="train")[:6]))
    prompts.write_text("".join(json.dumps({"messages": p.messages()[:1]}) + "\n"
                               for p in chat_prompts(split="heldout")[:2]))
    store, run, export, report = (tmp_path / name for name in ("store", "run", "export", "report"))
    extract = ok("extract", "--data", data, "--target", smollm2_target, "--out", store, "--backend", "vllm",
                 "--regenerate", "--temperature", "0", "--max-new-tokens", "24", "--max-seq-len", "256")
    assert "mask token 16 <empty_output> (an added special token the chat template never writes)" in extract.stdout
    assert "regenerated shard 0, round 1 of 2: 6 answers" in extract.stdout + extract.stderr
    info = ok("store", "info", "--store", store).stdout
    assert "outside_assistant 0" in info and "records      6 read, 0 skipped" in info, info
    rows = pq.read_table(next((store / "shards").glob("*.parquet"))).to_pylist()
    assert all(16 not in row["input_ids"] and sum(row["loss_mask"]) > 0 for row in rows)
    ok("vocab", "--store", store, "--draft-vocab-size", "256")
    ok("train", "--store", store, "--target", smollm2_target, "--out", run, "--max-steps", "4", "--num-depths", K,
       "--num-layers", "1", "--token-budget", "1024", "--num-workers", "0", "--heldout-fraction", "0",
       "--warmup-steps", "1", "--eval-every", "0", "--max-anchors", "8")
    ok("export", run, "--out", export)
    config = json.loads((export / "config.json").read_text())
    assert (config["mask_token_id"], config["draft_vocab_size"]) == (16, 256)
    ok("eval", export, "--target", smollm2_target, "--prompts", prompts, "--mode", "vllm",
       "--max-prompts", "2", "--max-new-tokens", "12", "--num-depths", K, "--quiet", "--out", report)
    served = json.loads((report / "report.json").read_text())["vllm"]
    assert served["parallel_drafting"] and served["num_depths"] == K and served["num_steps"] > 0
    assert served["greedy_output_matches_target_only"]
