"""The whole pipeline on targets shaped like the families people train drafts for (Llama-3.1, Qwen3,
and Mistral, whose tokenizer and template both write BOS), through the real CLI: extract (mask token
chosen from the target, chats with reasoning and tool turns) -> store info -> vocab -> train (the one
built vocab, the recorded mask token) -> export -> vLLM serving the export with parallel drafting.

Each family's chain runs once per test process. With vLLM importable the vLLM-marked test runs the
chain and serves the result (in the vLLM test process, scripts/test.sh); without vLLM the chain
alone is tested here. The drafts train for three steps: this proves every family's tokens, mask
token and export reach vLLM intact; that vLLM's parallel drafting computes what our own loop does
(acceptance equal) is tests/stages/eval/test_vllm_eval.py's job, on a draft fitted until it accepts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from peagle.stages.eval.vllm_eval import vllm_available
from peagle.testing.chat_data import write_agentic_jsonl

MASK = {  # the id, token string and rule each family's mask token must come from
    "llama3": ("128255 <|reserved_special_token_247|> (a reserved special token the chat template never writes)"),
    "qwen3": ("151669 (no token) (an embedding row past every id the tokenizer produces)"),
    "mistral": ("770 [control_768] (a reserved special token the chat template never writes)"),
}
FAMILIES = sorted(MASK)
DRAFT_VOCAB = 512
K = 3


def run_chain(family: str, target: Path, root: Path, run_peagle) -> dict:
    """extract -> store info -> vocab -> train -> export; returns paths and what each step printed."""
    def ok(*args):
        proc = run_peagle(*args)
        assert proc.returncode == 0, f"peagle {args[0]} failed:\n{proc.stderr[-3000:]}"
        return proc

    data = write_agentic_jsonl(root / "chats.jsonl", 6, seed=FAMILIES.index(family))
    store, run, export = root / "store", root / "run", root / "export"
    ok("extract", "--data", data, "--target", target, "--out", store, "--backend", "hf", "--topk", "8",
       "--max-seq-len", "1024", "--samples-per-shard", "4", "--device", "cpu", "--threads", "2")
    info = ok("store", "info", "--store", store).stdout
    ok("vocab", "--store", store, "--draft-vocab-size", DRAFT_VOCAB)
    train = ok("train", "--store", store, "--target", target, "--out", run, "--max-steps", "3", "--num-depths", K,
               "--num-layers", "1", "--token-budget", "2048", "--num-workers", "0", "--heldout-fraction", "0",
               "--warmup-steps", "1", "--eval-every", "0")
    ok("export", run, "--out", export)
    return {"store": store, "export": export, "info": info, "train": train.stderr, "target": target, "root": root}


def check_chain(family: str, chain: dict) -> None:
    info = chain["info"]
    assert f"mask token   {MASK[family]}" in info, info
    mask_id = int(MASK[family].split()[0])
    supervised = next(line for line in info.splitlines() if line.startswith("supervised"))
    turns = int(supervised.split(" in ")[1].split()[0])
    assert f"end_of_turn {turns}," in supervised and "outside_assistant 0" in supervised, supervised
    assert "tool_call 0," not in supervised, supervised  # the tool-call turns are supervised
    if family == "qwen3":  # the only family whose template renders reasoning; it also rewrites history
        assert "reasoning 0," not in supervised and "rendered turn by turn" in info, info
    for parquet in sorted((chain["store"] / "shards").glob("*.parquet")):
        assert all(mask_id not in row for row in pq.read_table(parquet).column("input_ids").to_pylist())
    assert f"draft vocab: the one `peagle vocab` built in {chain['store']} ({DRAFT_VOCAB} tokens" in chain["train"]
    config = json.loads((chain["export"] / "config.json").read_text())
    assert (config["mask_token_id"], config["draft_vocab_size"]) == (mask_id, DRAFT_VOCAB)


@pytest.fixture(scope="module")
def chains(family_target, tmp_path_factory, run_peagle):
    done: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in done:
            done[family] = run_chain(family, family_target(family), tmp_path_factory.mktemp(family), run_peagle)
        return done[family]

    return get


@pytest.mark.skipif(vllm_available(), reason="the vLLM-marked test runs this chain and serves its export")
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_on_real_family_targets(chains, family):
    check_chain(family, chains(family))


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here")
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_serves_each_family_with_parallel_drafting(chains, family, run_peagle):
    chain = chains(family)
    check_chain(family, chain)
    report_dir = chain["root"] / "report"
    proc = run_peagle("eval", chain["export"], "--target", chain["target"], "--store", chain["store"],
                      "--mode", "vllm", "--max-prompts", "2", "--max-new-tokens", "12", "--ignore-eos",
                      "--quiet", "--out", report_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads((report_dir / "report.json").read_text())["vllm"]
    assert served["parallel_drafting"] and served["num_depths"] == K and served["num_steps"] > 0
    assert served["greedy_output_matches_target_only"]  # speculative decoding never changes greedy output
    assert served["settings"]["route"] == "LLM(model=EXPORT_DIR)"
