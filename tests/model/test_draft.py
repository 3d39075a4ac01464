"""PEagleDraft against an obvious reference built from transformers' Llama and Qwen3 modules (the norms
before fc as vLLM's ``combine_hidden_states`` writes them), plus its gradients, checkpointing and
loading from a target (both tiny target architectures). Its layers' attention backends and RoPE:
test_decoder_layers.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3RotaryEmbedding

from peagle.model.draft import PEagleDraft, build_draft_from_target
from peagle.model.mask import dense_peagle_mask
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError
from peagle.testing.tiny_draft import LLAMA3_ROPE, cod_row, hf_llama_config, random_draft, small_config
from peagle.demo.tiny_target import MASK_TOKEN, TinyTargetSpec, build_tiny_target

def hf_modules(config: DraftConfig):
    """transformers' config, attention, decoder layer and rotary classes of the draft's architecture."""
    if config.architecture == "qwen3":
        layer = {k: v for k, v in config.layer_config_dict().items() if k not in ("model_type", "architectures")}
        return Qwen3Config(**layer), Qwen3Attention, Qwen3DecoderLayer, Qwen3RotaryEmbedding
    return hf_llama_config(config), LlamaAttention, LlamaDecoderLayer, LlamaRotaryEmbedding


def vllm_combine_hidden_states(draft: PEagleDraft, x_RF: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's ``Eagle3LlamaForCausalLM.combine_hidden_states`` (the same in qwen3_eagle3.py):
    ``input_norm`` over the whole row if norm_before_fc, then ``fc_norm[j]`` on each of the A chunks
    if fc_norm, then fc. Written with ``F.rms_norm``, not the draft's RMSNorm modules."""
    cfg = draft.config
    if cfg.norm_before_fc:
        x_RF = F.rms_norm(x_RF, (x_RF.shape[-1],), draft.input_norm.weight, cfg.rms_norm_eps)
    if cfg.fc_norm:
        x_RF = torch.cat([F.rms_norm(chunk, (chunk.shape[-1],), norm.weight, cfg.rms_norm_eps)
                          for chunk, norm in zip(x_RF.chunk(cfg.num_aux, dim=-1), draft.fc_norm)], dim=-1)
    return x_RF @ draft.fc.weight.T


def reference_forward(draft: PEagleDraft, token_ids_N, aux_RAH, position_ids_N, allowed_NN) -> torch.Tensor:
    """The obvious computation: every row builds its own layer-0 input (no sharing), transformers'
    Llama or Qwen3 attention (eager, additive mask), decoder layers and rotary embedding."""
    cfg = draft.config
    hf_cfg, attention_cls, layer_cls, rotary_cls = hf_modules(cfg)
    hf_cfg._attn_implementation = "eager"
    num_real, n = aux_RAH.shape[0], token_ids_N.shape[0]
    cos, sin = rotary_cls(hf_cfg)(torch.zeros(1), position_ids_N[None])
    additive = torch.zeros(n, n).masked_fill(~allowed_NN, float("-inf"))[None, None]

    hidden = torch.cat([aux_RAH.reshape(num_real, -1), draft.mask_hidden.reshape(1, -1).expand(n - num_real, -1)])
    hidden = vllm_combine_hidden_states(draft, hidden)
    ids = token_ids_N.clone()
    ids[num_real:] = cfg.mask_token_id
    layer0 = draft.layers[0]
    normed_hidden = layer0.hidden_norm(hidden)
    x = torch.cat([layer0.input_layernorm(draft.embed_tokens(ids)), normed_hidden], dim=-1)
    attn = attention_cls(hf_cfg, layer_idx=0)
    attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj = (layer0.self_attn.q_proj, layer0.self_attn.k_proj,
                                                          layer0.self_attn.v_proj, layer0.self_attn.o_proj)
    if cfg.architecture == "qwen3":  # transformers' own Qwen3RMSNorm modules, given the draft's weights
        attn.q_norm.load_state_dict(layer0.self_attn.q_norm.state_dict())
        attn.k_norm.load_state_dict(layer0.self_attn.k_norm.state_dict())
    residual = normed_hidden if cfg.norm_before_residual else hidden
    h = residual + attn(x[None], position_embeddings=(cos, sin), attention_mask=additive)[0][0]
    h = h + layer0.mlp(layer0.post_attention_layernorm(h))
    h = h[None]
    for i, layer in enumerate(draft.layers[1:], start=1):
        hf_layer = layer_cls(hf_cfg, layer_idx=i)
        hf_layer.load_state_dict(layer.state_dict())
        h = hf_layer(h, attention_mask=additive, position_embeddings=(cos, sin))
    return draft.norm(h[0])


VARIANTS = {  # every option alone, and all of them together on each decoder type
    "llama": {}, "norm_before_residual": {"norm_before_residual": True}, "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True}, "qwen3": {"architecture": "qwen3"},
    "llama_all": {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": True},
    "qwen3_all": {"architecture": "qwen3", "norm_before_residual": True, "norm_before_fc": True, "fc_norm": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE])
def test_forward_matches_transformers_reference(variant, rope):
    overrides = dict(VARIANTS[variant])
    if rope:
        overrides["rope_parameters"] = rope
    draft = random_draft(small_config(**overrides))
    anchor_N, depth_N, position_N = cod_row([7, 5], num_depths=3)
    num_real, n = int((depth_N == 0).sum()), anchor_N.numel()
    torch.manual_seed(1)
    token_ids_N = torch.randint(0, 199, (n,))
    token_ids_N[num_real:] = 199
    aux_RAH = torch.randn(num_real, 3, 64)
    allowed_NN = dense_peagle_mask(anchor_N, depth_N, torch.tensor([7, 5]), 12)

    got = draft(token_ids_N, aux_RAH, position_N, allowed_NN)
    want = reference_forward(draft, token_ids_N, aux_RAH, position_N, allowed_NN)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("option", ["architecture", "norm_before_residual", "norm_before_fc", "fc_norm"])
def test_every_option_changes_the_forward(option):
    """Not a no-op anywhere: the same weights without one option give other hidden states."""
    import dataclasses

    on = random_draft(small_config(**VARIANTS["qwen3_all"]))
    off = PEagleDraft(dataclasses.replace(on.config, **{option: "llama" if option == "architecture" else False}))
    missing, unexpected = off.load_state_dict(on.state_dict(), strict=False)
    assert not missing and bool(unexpected) == (option != "norm_before_residual")  # the option's own tensors
    anchor_N, depth_N, position_N = cod_row([7, 5], num_depths=3)
    num_real = int((depth_N == 0).sum())
    token_ids_N = torch.randint(0, 199, (anchor_N.numel(),))
    token_ids_N[num_real:] = 199
    aux_RAH, allowed_NN = 3 * torch.randn(num_real, 3, 64), dense_peagle_mask(anchor_N, depth_N, torch.tensor([7, 5]), 12)
    with torch.no_grad():
        diff = (on(token_ids_N, aux_RAH, position_N, allowed_NN) - off(token_ids_N, aux_RAH, position_N, allowed_NN)).abs()
    assert diff.max() > 1e-2


def test_frozen_embeddings_get_no_gradient_and_no_optimizer_state():
    from peagle.schemas.optimizer_settings import OptimizerSettings
    from peagle.stages.train.optim import build_optimizer

    draft = random_draft(small_config(), train_embeddings=False)
    anchor_N, depth_N, position_N = cod_row([9], num_depths=3)
    token_ids_N = torch.randint(0, 199, (anchor_N.numel(),))
    token_ids_N[9:] = 199
    mask = dense_peagle_mask(anchor_N, depth_N, torch.tensor([9]), 9)
    draft(token_ids_N, torch.randn(9, 3, 64), position_N, mask).sum().backward()
    assert draft.embed_tokens.weight.grad is None and draft.fc.weight.grad is not None
    for optimizer in ("muon", "adamw"):
        optimized = {id(p) for group in build_optimizer(draft, OptimizerSettings(optimizer=optimizer),
                                                        torch.device("cpu")).param_groups
                     for p in group["params"]}
        assert id(draft.embed_tokens.weight) not in optimized and id(draft.fc.weight) in optimized


def test_gradients_checkpointing_and_frozen_lm_head():
    config = small_config(draft_vocab_size=50)
    anchor_N, depth_N, position_N = cod_row([9], num_depths=3)
    num_real, n = 9, anchor_N.numel()
    token_ids_N = torch.randint(0, 199, (n,))
    token_ids_N[num_real:] = 199
    aux_RAH = torch.randn(num_real, 3, 64)
    mask = dense_peagle_mask(anchor_N, depth_N, torch.tensor([9]), 9)

    grads = []
    for checkpointing in (False, True):
        draft = random_draft(config, activation_checkpointing=checkpointing)
        draft.set_vocab_map(torch.arange(0, 100, 2))
        draft.compute_logits(draft(token_ids_N, aux_RAH, position_N, mask)).square().sum().backward()
        grads.append({name: p.grad for name, p in draft.named_parameters()})
    assert grads[0]["lm_head.weight"] is None
    for name, grad in grads[0].items():
        if name == "lm_head.weight":
            continue
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)

    trainable = PEagleDraft(config, train_lm_head=True)
    assert trainable.lm_head.weight.requires_grad


def test_batch_dim_and_bf16_autocast():
    draft = random_draft(small_config())
    token_ids_N = torch.tensor([5, 6, 7, 199, 199])
    aux_RAH = torch.randn(3, 3, 64, dtype=torch.bfloat16)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    plain = draft(token_ids_N, aux_RAH, torch.arange(5), mask)
    batched = draft(token_ids_N[None], aux_RAH[None], torch.arange(5)[None], mask)
    torch.testing.assert_close(batched, plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = draft.compute_logits(draft(token_ids_N, aux_RAH, torch.arange(5), mask))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), draft.compute_logits(plain), atol=0.05, rtol=0.05)


def test_vocab_maps_round_trip():
    draft = PEagleDraft(small_config(draft_vocab_size=4))
    ids = torch.tensor([3, 10, 11, 150])
    draft.set_vocab_map(ids)
    assert draft.d2t.tolist() == [3, 9, 9, 147]
    assert torch.equal(draft.draft_to_target(torch.arange(4)), ids)
    assert draft.target_to_draft(torch.tensor([10, 4, -1, 150, 3])).tolist() == [1, -1, -1, 3, 0]
    assert int(draft.t2d.sum()) == 4
    with pytest.raises(UserError):
        draft.set_vocab_map(torch.tensor([3, 2, 11, 150]))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_target(request, tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp(request.param) / "target", TinyTargetSpec(arch=request.param))


def test_build_draft_from_target_copies_embeddings_and_head_rows(tiny_target):
    hf_config = AutoConfig.from_pretrained(tiny_target)
    tokenizer = json.loads((tiny_target / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == MASK_TOKEN)
    config = DraftConfig.from_target_config(hf_config, num_layers=2, draft_vocab_size=100, mask_token_id=mask_id)
    ids = torch.randperm(hf_config.vocab_size, generator=torch.Generator().manual_seed(0))[:100].sort().values
    draft = build_draft_from_target(tiny_target, config, ids)

    with safe_open(tiny_target / "model.safetensors", framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        head = f.get_tensor("lm_head.weight").float()
    assert torch.equal(draft.embed_tokens.weight, embed)
    assert torch.equal(draft.lm_head.weight, head[ids])
    assert torch.equal(draft.draft_to_target(torch.arange(100)), ids)
    assert not draft.lm_head.weight.requires_grad and draft.embed_tokens.weight.requires_grad
    assert all(p.dtype == torch.float32 for p in draft.parameters())

    full = build_draft_from_target(tiny_target, DraftConfig.from_target_config(hf_config, mask_token_id=mask_id))
    assert torch.equal(full.lm_head.weight, head) and full.d2t.abs().sum() == 0 and bool(full.t2d.all())


@pytest.mark.parametrize("variant", [{}, {"architecture": "qwen3", "norm_before_fc": True, "fc_norm": True},
                                     {"method": "eagle3", "mask_token_id": None}])
def test_every_weight_is_drawn_once_from_the_seed(variant):
    """The modules are made on the meta device and every weight is drawn once by reset_parameters:
    the same seed gives the same draft, every weight has its init's statistics (none is left as the
    uninitialised memory ``to_empty`` hands out), and no constructor init runs first."""
    config = small_config(num_layers=2, **variant)
    drafts = []
    for _ in range(2):
        torch.manual_seed(3)
        drafts.append(PEagleDraft(config))
    for (name, a), b in zip(drafts[0].named_parameters(), drafts[1].parameters()):
        assert torch.equal(a, b), name
        if "norm" in name:
            assert bool((a == 1).all()), name
        elif name != "mask_hidden":
            assert abs(float(a.detach().std()) - 0.02) < 0.005 and bool(a.isfinite().all()), name
    torch.manual_seed(3)
    first_draw = torch.empty(config.target_vocab_size, config.hidden_size).normal_(0.0, 0.02)
    assert torch.equal(drafts[0].embed_tokens.weight, first_draw)  # nothing drew before reset_parameters


def test_reset_parameters_refuses_a_weight_it_does_not_draw():
    draft = PEagleDraft(small_config())
    draft.extra = torch.nn.Parameter(torch.empty(3))
    with pytest.raises(AssertionError, match="extra"):
        draft.reset_parameters()


def test_build_draft_from_target_user_errors(tiny_target, tmp_path):
    hf_config = AutoConfig.from_pretrained(tiny_target)
    config = DraftConfig.from_target_config(hf_config, draft_vocab_size=10, mask_token_id=5)
    with pytest.raises(UserError, match="needs draft_token_ids"):
        build_draft_from_target(tiny_target, config)
    with pytest.raises(UserError, match="draft_vocab_size"):
        build_draft_from_target(tiny_target, config, torch.arange(11))
    with pytest.raises(UserError, match="no model.safetensors"):
        build_draft_from_target(tmp_path, config, torch.arange(10))
    wrong = DraftConfig.from_dict({**config.to_dict(), "hidden_size": 64, "target_hidden_size": 64})
    with pytest.raises(UserError, match="embed_tokens shape"):
        build_draft_from_target(tiny_target, wrong, torch.arange(10))
