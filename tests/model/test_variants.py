"""Draft variants (``--draft-architecture``, ``--norm-before-residual``, ``--norm-before-fc``,
``--fc-norm``): each builds, trains a real trainer step (its own tensors get gradients), and comes
back from the export with the same weights, config and logits; config.json states each option where
vLLM 0.32 reads it; a warm start refuses another variant. That vLLM serves each one:
tests/stages/eval/test_vllm_variants.py; that our forward computes what vLLM's does:
tests/model/test_draft.py (``test_forward_matches_transformers_reference``)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from peagle.model.draft import PEagleDraft
from peagle.model.proposer import propose
from peagle.model.speculators_format import load_export, load_weights_into, write_export
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig
from peagle.testing.trainer import trainer_for_draft

sys.path.insert(0, str(Path(__file__).parents[1] / "stages" / "train"))  # sibling helpers, any import mode
from test_partition_equivalence import (DRAFT_VOCAB, HIDDEN, K, MASK_TOKEN, NUM_AUX, TARGET_VOCAB,  # noqa: E402
                                        batch_of, random_items)

VARIANTS = {
    "llama": {},
    "qwen3": {"architecture": "qwen3"},
    "norm-before-residual": {"norm_before_residual": True},
    "norm-before-fc": {"norm_before_fc": True},
    "fc-norm": {"fc_norm": True},
    "qwen3-all": {"architecture": "qwen3", "norm_before_residual": True, "norm_before_fc": True, "fc_norm": True},
}

OWN_TENSORS = {  # the state-dict keys each option adds (vLLM's names)
    "architecture": re.compile(r"^layers\.\d+\.self_attn\.[qk]_norm\.weight$"),
    "norm_before_fc": re.compile(r"^input_norm\.weight$"),
    "fc_norm": re.compile(r"^fc_norm\.\d+\.weight$"),
}


def variant_draft(variant: str, seed: int = 0, **changes) -> PEagleDraft:
    config = DraftConfig(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         num_layers=2, target_hidden_size=HIDDEN, num_aux=NUM_AUX, target_vocab_size=TARGET_VOCAB,
                         draft_vocab_size=DRAFT_VOCAB, mask_token_id=MASK_TOKEN, max_position_embeddings=512,
                         aux_layer_ids=[1, 2, 3], **{**VARIANTS[variant], **changes})
    torch.manual_seed(seed)
    draft = PEagleDraft(config)
    draft.set_vocab_map(torch.arange(0, 2 * DRAFT_VOCAB, 2))
    with torch.no_grad():  # non-trivial norms: a norm dropped on the way shows in the logits
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return draft


def own_tensors(draft: PEagleDraft) -> set[str]:
    return {name for name in draft.state_dict() if any(p.match(name) for p in OWN_TENSORS.values())}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_trains_a_step_and_round_trips_through_the_export(variant, tmp_path):
    draft = variant_draft(variant)
    config = draft.config
    expected = ({f"layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"} if config.architecture == "qwen3"
                else set()) | ({"input_norm.weight"} if config.norm_before_fc else set()) | (
                {f"fc_norm.{j}.weight" for j in range(NUM_AUX)} if config.fc_norm else set())
    assert own_tensors(draft) == expected

    train_config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", num_depths=K,
                                          attention="sdpa", max_steps=1, lr=1e-2, warmup_steps=0)
    trainer = trainer_for_draft(train_config, draft)
    before = {name: p.detach().clone() for name, p in draft.named_parameters()}
    result = trainer.train_step([batch_of(random_items(0, [20, 13]), 1)])
    assert math.isfinite(float(result.stats.loss_sum))
    for name in expected:  # the variant's own tensors train
        assert not torch.equal(dict(draft.named_parameters())[name], before[name]), name

    out = write_export(draft.state_dict(), config, tmp_path / "export", verifier_name="org/v",
                       verifier_architectures=["LlamaForCausalLM"], speculative_tokens=K,
                       provenance={"draft_config": config.to_dict()})
    loaded = load_export(out)
    assert loaded.draft.config == config
    assert loaded.draft.state_dict().keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.draft.state_dict()[name], tensor), name
    draft.eval()
    tokens, aux = torch.randint(0, MASK_TOKEN, (12,)), 3 * torch.randn(11, NUM_AUX, HIDDEN)
    torch.testing.assert_close(propose(loaded.draft, tokens, aux, K).logits_KV, propose(draft, tokens, aux, K).logits_KV,
                               atol=0, rtol=0)

    # config.json states every option where vLLM 0.32 reads it (speculators_config.py's docstring)
    config_json = json.loads((out / "config.json").read_text())
    layer = config_json["transformer_layer_config"]
    assert layer["model_type"] == config.architecture
    assert (config_json["norm_before_residual"], config_json["norm_before_fc"]) == (config.norm_before_residual,
                                                                                    config.norm_before_fc)
    assert layer.get("fc_norm", False) == config_json["fc_norm"] == config.fc_norm
    assert config_json["norm_output"] is False


def test_qwen3_draft_trains_under_bf16_autocast():
    """The q/k norms' fp32 weights must not turn bf16 queries into fp32 ones before attention."""
    draft = variant_draft("qwen3-all")
    config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", num_depths=K, attention="sdpa",
                                    max_steps=1)
    trainer = trainer_for_draft(config, draft, compute_dtype=torch.bfloat16)
    stats, _ = trainer.step_fn.forward_backward([batch_of(random_items(1, [17]), 1)])
    assert math.isfinite(float(stats.loss_sum))
    assert all(p.grad is not None for name, p in draft.named_parameters() if name in own_tensors(draft))


def test_warm_start_keeps_the_variant(tmp_path):
    from safetensors.torch import save_file

    source = variant_draft("qwen3-all", seed=1)
    out = write_export(source.state_dict(), source.config, tmp_path / "export", verifier_name="v",
                       verifier_architectures=[], speculative_tokens=K)
    same = variant_draft("qwen3-all", seed=2)
    assert load_weights_into(same, out).endswith("tensors loaded")  # nothing kept at init
    for name, tensor in source.state_dict().items():
        assert torch.equal(same.state_dict()[name], tensor), name
    for changes, flag in (({"architecture": "llama"}, "--draft-architecture qwen3"),
                          ({"norm_before_fc": False}, "--norm-before-fc"), ({"fc_norm": False}, "--fc-norm")):
        with pytest.raises(UserError, match=re.escape(f"trained with {flag} ")):
            load_weights_into(variant_draft("qwen3-all", **changes), out)
    flipped = variant_draft("norm-before-residual")
    plain = write_export(variant_draft("llama").state_dict(), variant_draft("llama").config, tmp_path / "plain",
                         verifier_name="v", verifier_architectures=[], speculative_tokens=K)
    with pytest.raises(UserError, match="trained with --no-norm-before-residual"):
        load_weights_into(flipped, plain)
    # Today's default draft (every norm on) from a plain export: one line names all three flags.
    with pytest.raises(UserError, match=re.escape("pass --no-norm-before-residual --no-norm-before-fc --no-fc-norm:")):
        load_weights_into(variant_draft("qwen3-all", architecture="llama"), plain)

    # A bare weights directory (no config.json) states nothing; its norm tensors still tell.
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({k: v.contiguous() for k, v in variant_draft("norm-before-fc").state_dict().items()},
              str(bare / "model.safetensors"))
    with pytest.raises(UserError, match="'input_norm.weight', which this run's draft lacks"):
        load_weights_into(variant_draft("llama"), bare)


def test_reading_refuses_what_the_draft_cannot_compute(tmp_path):
    draft = variant_draft("llama")
    out = write_export(draft.state_dict(), draft.config, tmp_path / "export", verifier_name="v",
                       verifier_architectures=[], speculative_tokens=K)
    config_json = json.loads((out / "config.json").read_text())
    for change, message in (({"norm_output": True}, "norm_output"), ({"transformer_layer_config": {
            **config_json["transformer_layer_config"], "model_type": "mistral"}}, "'mistral'")):
        (out / "config.json").write_text(json.dumps({**config_json, **change}))
        with pytest.raises(UserError, match=message):
            load_export(out)
