"""benchmarks/own_loop.py on the tiny Llama target: both attention settings decode the same tokens,
every figure the JSON carries is there and adds up; what it says about time is the benchmark's."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoTokenizer

from peagle.model.draft import build_draft_from_target
from peagle.model.speculators_format import write_export
from peagle.schemas.draft_config import DraftConfig


def test_a_tiny_run_writes_both_settings_and_their_parts(tmp_path, tiny_llama, load_benchmark) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    config = DraftConfig.from_target_config(AutoConfig.from_pretrained(tiny_llama), num_layers=1, draft_vocab_size=512,
                                            mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"))
    torch.manual_seed(0)
    draft = build_draft_from_target(tiny_llama, config, torch.arange(0, 1024, 2))
    export = write_export(draft.state_dict(), draft.config, tmp_path / "export", verifier_name=str(tiny_llama),
                          verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n"
                               for t in ("Parse a CSV line.", "What does json.dumps return?")))
    out = tmp_path / "own_loop.json"
    with load_benchmark("own_loop.py") as bench:
        bench.main(["--export", str(export), "--target", str(tiny_llama), "--prompts", str(prompts), "--k", "3",
                    "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--no-compiled",
                    "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["attention"]) == {"sdpa", "gqa_attention"} and "compiled" not in result
    runs = [result["attention"][name]["runs"][0] for name in ("sdpa", "gqa_attention")]
    for run in runs:
        assert run["acceptance_length"] >= 1 and run["speedup"] > 0
        parts = run["verify_ms"] + run["draft_ms"] + run["spec_rest_ms"]
        assert abs(parts - run["spec_step_ms"]) < 1e-6 * max(1.0, run["spec_step_ms"])
    assert runs[0]["acceptance_length"] == runs[1]["acceptance_length"]  # the same tokens either way
