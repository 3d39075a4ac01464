"""The export's ``config.json`` both ways: :func:`build_config` writes it, :func:`draft_config_from_speculators`
reads it back as a DraftConfig, :func:`variant_of` reads the decoder type and norm options only.

Two speculators model types, one per drafting method (``DraftConfig.method``): ``peagle`` (vLLM
serves it with parallel drafting) and ``eagle3`` (sequential drafting). They differ only in the
type, ``architectures``, the algorithm and P-EAGLE's ``mask_token_id``; the layer config, the norm
options and the tensors (but ``mask_hidden``) are the same.

Part of the speculators format, whose entry point (``write_export``, ``load_export``, warm
start) is peagle/model/speculators_format.py; this module holds the config half so that each
direction of each field is written next to the other (docs/draft-and-export.md).

Where vLLM 0.32 reads each variant field (vllm/transformers_utils/configs/speculators/algos.py
``update_peagle`` builds the draft's HF config from ``transformer_layer_config`` and copies
``norm_before_residual``, ``norm_before_fc`` and ``mask_token_id`` from the top level; nothing
else):

* ``transformer_layer_config.model_type``: ``llama`` or ``qwen3`` picks the model class;
* ``norm_before_residual``, ``norm_before_fc``: top level;
* ``fc_norm``: read with ``getattr(hf_config, "fc_norm")``, so it must be inside
  ``transformer_layer_config``; it is also written at the top level, where speculators keeps it;
* ``norm_output``: changes only the hidden state vLLM feeds into a *next* draft forward, which
  parallel drafting never runs (one forward proposes all K tokens), so it is always False here.
"""

from __future__ import annotations

import copy
from typing import Any

from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose format this writes (config field ``speculators_version``)."""

ARCHITECTURE = "PEagleDraftModel"
"""What speculators 0.9.0 writes in ``architectures`` when it saves a P-EAGLE draft."""

ARCHITECTURES = {"peagle": ARCHITECTURE, "eagle3": "Eagle3DraftModel"}
"""``architectures`` per speculators model type: the class ``save_pretrained`` records (vLLM reads
neither: its ``update_peagle``/``update_eagle3`` set the model class from the decoder type)."""

SPECULATORS_MODEL_TYPES = ("peagle", "eagle3")
"""The speculators model types written and read here: ``DraftConfig.method`` values, one each."""

PROVENANCE_KEY = "peagle"

VARIANT_FLAGS = {"architecture": "--draft-architecture", "norm_before_residual": "--norm-before-residual",
                 "norm_before_fc": "--norm-before-fc", "fc_norm": "--fc-norm"}
"""The DraftConfig fields that make a draft variant, and the `peagle train` flag of each."""


def build_config(config: DraftConfig, *, verifier_name: str, verifier_architectures: list[str],
                 speculative_tokens: int, dtype: str = "float32",
                 provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """The export's ``config.json`` (speculators 0.9.0 fields; what vLLM 0.32's loader reads).

    ``speculative_tokens`` is K, the number of draft tokens vLLM proposes per step (the served
    default; ``LLM(..., speculative_config={"num_speculative_tokens": k})`` overrides it).
    ``provenance`` becomes the ``peagle`` section (speculators keeps unknown keys; vLLM ignores them).
    """
    if speculative_tokens < 1:
        raise UserError(f"--speculative-tokens must be >= 1, got {speculative_tokens}")
    layer_config = copy.deepcopy(config.layer_config_dict())
    layer_config["dtype"] = dtype
    if config.num_aux != 3:
        # vLLM sizes fc as target_hidden_size * num_aux_hidden_states with a default of 3, and reads
        # the attribute from the draft's HF config, which is built from transformer_layer_config.
        layer_config["num_aux_hidden_states"] = config.num_aux
    if config.fc_norm:
        layer_config["fc_norm"] = True  # update_peagle does not copy it from the top level
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[config.method]], "speculators_model_type": config.method,
        "speculators_version": SPECULATORS_VERSION, "dtype": dtype,
        "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        **({"mask_token_id": config.mask_token_id} if config.method == "peagle" else {}),
        # Always written: vLLM assumes False for a P-EAGLE config and True for an EAGLE-3 one without it.
        "norm_before_residual": config.norm_before_residual, "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm, "norm_output": False, "embed_requires_grad": True, "tie_word_embeddings": False,
        "transformer_layer_config": layer_config,
        "speculators_config": {
            "algorithm": config.method, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
        },
    }
    if config.num_aux != 3:
        out["num_aux_hidden_states"] = config.num_aux
    if provenance is not None:
        out[PROVENANCE_KEY] = provenance
    return out


def variant_of(config_json: dict[str, Any]) -> dict[str, Any]:
    """The variant fields (:data:`VARIANT_FLAGS`) a speculators config.json states, read as vLLM reads
    them; a field the config leaves out is left out (an EAGLE-3 checkpoint's defaults differ).

    Raises:
        UserError: a decoder type or option peagle's draft does not implement.
    """
    if config_json.get("norm_output"):
        raise UserError("checkpoint uses norm_output=true, which peagle's draft model does not implement")
    layer = config_json.get("transformer_layer_config") or {}
    architecture = layer.get("model_type", "llama")
    if architecture not in ("llama", "qwen3"):
        raise UserError(f"checkpoint decoder is {architecture!r}; peagle reads llama and qwen3 decoders")
    out: dict[str, Any] = {"architecture": architecture,
                           "fc_norm": bool(layer.get("fc_norm") or config_json.get("fc_norm"))}
    for name in ("norm_before_residual", "norm_before_fc"):
        if name in config_json:
            out[name] = bool(config_json[name])
    return out


def draft_config_from_speculators(config_json: dict[str, Any]) -> DraftConfig:
    """The DraftConfig a speculators 'peagle' or 'eagle3' config.json describes.

    Raises:
        UserError: for a config this draft model cannot represent.
    """
    method = config_json.get("speculators_model_type")
    if method not in SPECULATORS_MODEL_TYPES:
        raise UserError(f"not a speculators 'peagle' or 'eagle3' checkpoint (speculators_model_type={method!r})")
    # vLLM's defaults where the config is silent: update_peagle reads norm_before_residual as False,
    # update_eagle3 as True.
    variant = {"norm_before_residual": method == "eagle3", "norm_before_fc": False, **variant_of(config_json)}
    layer = config_json.get("transformer_layer_config") or {}
    if method == "peagle" and config_json.get("mask_token_id") is None:
        raise UserError("checkpoint config has no mask_token_id")
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    aux_ids = list(config_json.get("eagle_aux_hidden_state_layer_ids") or [])
    num_aux = int(layer.get("num_aux_hidden_states") or config_json.get("num_aux_hidden_states") or len(aux_ids) or 3)
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(layer.get("rope_theta", 10000.0))}
    return DraftConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_parameters=dict(rope),
        num_layers=int(layer["num_hidden_layers"]), target_hidden_size=int(config_json.get("target_hidden_size") or hidden),
        num_aux=num_aux, target_vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(config_json.get("draft_vocab_size") or layer["vocab_size"]),
        mask_token_id=int(config_json["mask_token_id"]) if method == "peagle" else None, method=method,
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)), aux_layer_ids=aux_ids, **variant,
    )
