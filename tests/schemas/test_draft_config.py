"""DraftConfig: derived from both tiny target architectures, JSON round trip, one-line user errors."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, LlamaConfig

from peagle.schemas.draft_config import DraftConfig, default_aux_layer_ids
from peagle.schemas.errors import UserError
from peagle.demo.tiny_target import TinyTargetSpec, build_config, build_tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target_config(request):
    # The config alone (no weights) is enough here; it is what build_tiny_target saves.
    return build_config(TinyTargetSpec(arch=request.param), build_tokenizer(1024, request.param))


def test_from_target_config_copies_the_target_shape(target_config):
    config = DraftConfig.from_target_config(target_config, draft_vocab_size=300, mask_token_id=7)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (128, 4, 2, 32)
    assert config.intermediate_size == 256 and config.rms_norm_eps == 1e-5
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.num_layers == 4 and config.num_aux == 3 and config.aux_layer_ids == [2, 4, 5]
    assert config.target_vocab_size == target_config.vocab_size and config.draft_vocab_size == 300
    assert config.target_hidden_size == 128 and config.max_position_embeddings == 4096
    assert config.has_vocab_map and not config.norm_before_residual

    full = DraftConfig.from_target_config(target_config, num_layers=1, mask_token_id=7, aux_layer_ids=[0, 8])
    assert full.draft_vocab_size == full.target_vocab_size and not full.has_vocab_map
    assert full.num_aux == 2 and full.num_layers == 1
    with pytest.raises(UserError, match="exceed"):
        DraftConfig.from_target_config(target_config, mask_token_id=7, aux_layer_ids=[2, 9])


def test_round_trip_through_json(target_config):
    config = DraftConfig.from_target_config(target_config, draft_vocab_size=300, mask_token_id=7,
                                            norm_before_residual=True)
    data = json.loads(json.dumps(config.to_dict()))
    assert DraftConfig.from_dict(data) == config
    data["rope_parameters"]["rope_theta"] = 1.0  # to_dict hands out copies
    assert config.rope_parameters["rope_theta"] == 10000.0


def test_llama_config_dict_is_a_transformers_llama_config(target_config):
    config = DraftConfig.from_target_config(target_config, mask_token_id=7)
    llama = LlamaConfig(**config.llama_config_dict())
    assert llama.num_hidden_layers == 4 and llama.head_dim == 32 and not llama.tie_word_embeddings
    assert llama.rope_parameters["rope_theta"] == 10000.0


def test_qwen3_layer_config_is_a_transformers_qwen3_config(target_config):
    from transformers import Qwen3Config

    config = DraftConfig.from_target_config(target_config, mask_token_id=7, architecture="qwen3", fc_norm=True)
    layer = config.layer_config_dict()
    assert (layer["model_type"], layer["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    qwen3 = Qwen3Config(**{k: v for k, v in layer.items() if k != "model_type"})
    assert qwen3.head_dim == 32 and qwen3.num_hidden_layers == 4 and not qwen3.attention_bias
    assert DraftConfig.from_target_config(target_config, mask_token_id=7).layer_config_dict()["model_type"] == "llama"


def test_a_config_saved_before_the_variants_is_a_plain_llama_draft(target_config):
    """Checkpoints written before --draft-architecture and the norm flags existed resume as what they were."""
    data = DraftConfig.from_target_config(target_config, mask_token_id=7).to_dict()
    for name in ("architecture", "norm_before_fc", "fc_norm"):
        del data[name]
    config = DraftConfig.from_dict(data)
    assert (config.architecture, config.norm_before_fc, config.fc_norm) == ("llama", False, False)


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(8) == [2, 4, 5]
    assert default_aux_layer_ids(32) == [2, 16, 29]


@pytest.mark.parametrize("change, message", [
    ({"aux_layer_ids": [4, 2, 5]}, "strictly ascending"),
    ({"aux_layer_ids": [2, 2, 5]}, "strictly ascending"),
    ({"aux_layer_ids": [2, 4]}, "num_aux"),
    ({"mask_token_id": 1024}, "mask_token_id"),
    ({"draft_vocab_size": 2000}, "exceeds"),
    ({"num_kv_heads": 3}, "multiple"),
    ({"num_layers": 0}, "num_layers"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "not supported"),
    ({"rope_parameters": {"rope_type": "default"}}, "rope_theta"),
    ({"surprise": 1}, "unknown keys"),
    ({"architecture": "mistral"}, r"architecture .mistral. is not one of llama\|qwen3"),
])
def test_invalid_configs_are_user_errors(target_config, change, message):
    data = DraftConfig.from_target_config(target_config, mask_token_id=7).to_dict()
    data.update(change)
    with pytest.raises(UserError, match=message):
        DraftConfig.from_dict(data)


def test_missing_keys_are_user_errors(target_config):
    data = DraftConfig.from_target_config(target_config, mask_token_id=7).to_dict()
    del data["head_dim"]
    with pytest.raises(UserError, match="missing keys"):
        DraftConfig.from_dict(data)


def test_saved_tiny_target_config_loads(tmp_path, target_config):
    target_config.save_pretrained(tmp_path)
    config = DraftConfig.from_target_config(AutoConfig.from_pretrained(tmp_path), mask_token_id=7)
    assert config.head_dim == 32
