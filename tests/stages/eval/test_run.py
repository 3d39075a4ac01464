"""`peagle eval` end to end on a run directory: export, offline chains, own loop, report."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from peagle.model.draft import build_draft_from_target
from peagle.schemas.draft_config import DraftConfig
from peagle.stages.eval.vllm_eval import vllm_available


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_llama):
    """A tiny store (HF extraction) and a run directory holding one checkpoint of a random draft."""
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.stages.train import checkpoint as ckpt
    from peagle.testing.chat_data import write_chat_jsonl

    root = tmp_path_factory.mktemp("eval-run")
    data = write_chat_jsonl(root / "chat.jsonl", 6, seed=9)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), backend="hf",
                              topk=4, samples_per_shard=3, device="cpu", max_seq_len=256),
                echo=lambda _: None, progress=False)
    config = DraftConfig.from_target_config(
        AutoConfig.from_pretrained(tiny_llama), num_layers=1, draft_vocab_size=512,
        mask_token_id=AutoTokenizer.from_pretrained(tiny_llama).convert_tokens_to_ids("<|mask|>"))
    torch.manual_seed(0)
    draft = build_draft_from_target(tiny_llama, config, torch.arange(512))
    part = {"train_config": {"target": str(tiny_llama), "num_depths": 3, "store": [str(root / "store")],
                             "heldout_fraction": 0.0, "eval_store": None},
            "draft_config": config.to_dict(), "world_size": 1, "store_manifest_hash": "0" * 64}
    ckpt.Checkpointer(root / "run", keep=1).save(7, {ckpt.MODEL: draft.state_dict(), ckpt.OPTIMIZER: {},
                                                     ckpt.LR_SCHEDULER: {}, ckpt.TRAIN_STATE: {}, ckpt.CONFIG: part,
                                                     ckpt.DATALOADER: {}, ckpt.RNG: {}})
    (root / "run" / "metrics.jsonl").write_text(json.dumps(
        {"kind": "train", "step": 7, "loss": 4.0, "depth_agreement": [0.1, 0.1, 0.1], "acceptance_length_estimate": 1.1})
        + "\n")
    return root / "run"


def test_cli_eval_on_a_run_directory(run_dir, tiny_llama, run_peagle):
    done = run_peagle("eval", run_dir, "--target", tiny_llama, "--mode", "offline,online", "--max-new-tokens", "8",
                      "--max-prompts", "2", "--max-samples", "4", "--quiet")
    assert done.returncode == 0, done.stderr
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert (run_dir / "eval" / "export" / "model.safetensors").is_file()  # eval measured the export
    assert report["meta"]["num_depths"] == 3 and report["meta"]["modes"] == ["offline", "online"]
    assert report["offline"]["num_samples"] == 4 and report["offline"]["num_chains"] > 0
    assert report["online"]["num_prompts"] == 2 and report["online"]["greedy_output_matches_plain"] is True
    assert "store" in report["online"]["prompt_source"]
    assert set(report["plots"]) == {"per_depth_acceptance", "acceptance_length", "training_curves"}
    assert "offline" in done.stdout and "report:" in done.stdout


@pytest.mark.skipif(vllm_available(), reason="checks the message shown when vLLM is missing")
def test_cli_eval_vllm_mode_without_vllm_is_one_clear_line(run_dir, tiny_llama, run_peagle, tmp_path):
    done = run_peagle("eval", run_dir, "--target", tiny_llama, "--mode", "vllm", "--out", tmp_path / "r")
    assert done.returncode == 2 and "vLLM" in done.stderr and "Traceback" not in done.stderr
