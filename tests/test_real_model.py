"""The whole pipeline on a real trained model, SmolLM2-135M-Instruct (`peagle target fetch smollm2`),
through the real CLI as the demo runs it: extract with vLLM regenerating the answers (the mask token
chosen with no flag) into an fp8 store (``--hidden-dtype fp8``), vocab, train, export, and vLLM
serving the export with parallel drafting. The extract prints peagle's own lines only, none of the
output of vLLM's two engines (generation, then extraction).

This is also the vLLM backend's fp8 store end to end (the HF backend's, with held-out evaluation
during training and offline chains, is tests/test_cli_fp8.py's): both backends hand their aux rows
to the same fp8 writer, and an export does not depend on the dtype of the store it was trained on.

The draft trains a few steps only: what this proves is that a real tokenizer, template and model go
through every stage and reach vLLM intact, with greedy output unchanged. What a draft for it
accepts is measured by the demo and benchmarks/quality.py (docs/quality.md). Our own loop
(``--mode online``) is not run here: it is the same code for every Llama-architecture target, and its
greedy output equal to plain decoding is tests/stages/eval/test_online.py's and
tests/stages/eval/test_run.py's (the command), its acceptance equal to vLLM's
tests/stages/eval/test_vllm_eval.py's and test_vllm_eagle3.py's (on SmolLM2 it cost ~15 s of CPU).
"""

from __future__ import annotations

import json
import re
import subprocess

import pyarrow.parquet as pq
import pytest

from peagle.pipeline.store import open_store
from peagle.stages.eval.vllm_eval import vllm_available
from peagle.demo.chat_prompts import chat_prompts

K = 5


def assert_only_peagles_lines(extract: subprocess.CompletedProcess) -> None:
    """`peagle extract --backend vllm --regenerate` of the 6 chats through the real console script:
    the plan, where the time went and the commit line on stdout, the rounds of regeneration and progress on stderr, and
    nothing else (none of vLLM's INFO/WARNING lines from its processes, torch's warnings or vLLM's
    weight-loading bar); no carriage returns when the output is not a terminal."""
    out, err = extract.stdout.splitlines(), extract.stderr.splitlines()
    assert "\r" not in extract.stdout + extract.stderr
    assert out[0].startswith("peagle extract plan") and out[-1].startswith("committed 1 shards")
    assert all(line.startswith("  ") for line in out[1:-1]), extract.stdout  # the plan's own lines, the time's
    assert out[-2].startswith("  time ") and "regenerating answers and templating" in out[-2]
    rounds = [line for line in err if re.fullmatch(r"regenerated shard 0, round [12] of 2: .*", line)]
    progress = [line for line in err if re.fullmatch(r"extract: \d/6 rec \(\d+%\), .*", line)]
    assert len(rounds) == 2 and progress and len(rounds) + len(progress) == len(err), extract.stderr


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
                 "--regenerate", "--temperature", "0", "--max-new-tokens", "24", "--max-seq-len", "256",
                 "--hidden-dtype", "fp8")
    assert "mask token 16 <empty_output> (an added special token the chat template never writes)" in extract.stdout
    assert "regenerated shard 0, round 1 of 2: 6 answers" in extract.stdout + extract.stderr
    assert_only_peagles_lines(extract)
    assert open_store(store).settings.hidden_dtype == "fp8"
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
