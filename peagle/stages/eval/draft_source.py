"""Load the draft that evaluation measures from an export directory (speculators 'peagle' format).

Evaluation reads what vLLM serves: `peagle eval RUN_DIR` first exports (the CLI does that), so the
own loop, the offline chains and vLLM all see the same ``model.safetensors``. The draft's shape is
derived from the speculators fields of ``config.json`` (so a speculators-trained P-EAGLE
checkpoint can be evaluated too) and, for peagle exports, checked against the ``peagle.draft_config``
provenance section.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.model.draft import PEagleDraft
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
OPTIONAL_KEYS = {"d2t", "t2d"}  # absent when the draft vocab is the whole target vocab


@dataclass(kw_only=True)
class ExportedDraft:
    """A loaded export: the draft (fp32, eval mode) and what its config.json says."""

    path: Path
    draft: PEagleDraft
    config_json: dict[str, Any]
    speculative_tokens: int
    verifier: str
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def run_config(self) -> dict[str, Any]:
        return self.provenance.get("run_config") or {}

    @property
    def num_depths_trained(self) -> int | None:
        return self.provenance.get("num_depths_trained")


def is_export_dir(path: str | os.PathLike) -> bool:
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text()).get("speculators_model_type") == "peagle"
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def draft_config_from_speculators(config_json: dict[str, Any]) -> DraftConfig:
    """The DraftConfig a speculators 'peagle' config.json describes (Llama decoder, no extra norms).

    Raises:
        UserError: for a config this draft model cannot represent.
    """
    if config_json.get("speculators_model_type") != "peagle":
        raise UserError(f"not a speculators 'peagle' checkpoint (speculators_model_type="
                        f"{config_json.get('speculators_model_type')!r})")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if config_json.get(flag):
            raise UserError(f"checkpoint uses {flag}=true, which peagle's draft model does not implement")
    layer = config_json.get("transformer_layer_config") or {}
    if layer.get("model_type", "llama") != "llama":
        raise UserError(f"checkpoint decoder is {layer.get('model_type')!r}; peagle evaluates llama decoders only")
    if config_json.get("mask_token_id") is None:
        raise UserError("checkpoint config has no mask_token_id")
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    aux_ids = list(config_json.get("eagle_aux_hidden_state_layer_ids") or [])
    num_aux = int(layer.get("num_aux_hidden_states") or config_json.get("num_aux_hidden_states") or len(aux_ids) or 3)
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(layer.get("rope_theta", 10000.0))}
    return DraftConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        num_layers=int(layer["num_hidden_layers"]),
        target_hidden_size=int(config_json.get("target_hidden_size") or hidden),
        num_aux=num_aux,
        target_vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(config_json.get("draft_vocab_size") or layer["vocab_size"]),
        mask_token_id=int(config_json["mask_token_id"]),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        aux_layer_ids=aux_ids,
        norm_before_residual=bool(config_json.get("norm_before_residual", False)),
    )


def load_export(path: str | os.PathLike) -> ExportedDraft:
    """Load an export directory into a PEagleDraft (fp32, eval mode), checking every key and shape.

    Raises:
        UserError: when the directory is not a 'peagle' export or its tensors do not fit its config.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise UserError(f"{path} is not an export directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config_json = json.loads((path / CONFIG_FILE).read_text())
    config = draft_config_from_speculators(config_json)
    provenance = config_json.get("peagle") or {}
    recorded = provenance.get("draft_config")
    if recorded is not None and DraftConfig.from_dict(recorded).to_dict() != config.to_dict():
        raise UserError(f"{path / CONFIG_FILE}: the speculators fields and peagle.draft_config disagree")
    draft = PEagleDraft(config)
    tensors = load_file(str(path / WEIGHTS_FILE))
    own = draft.state_dict()
    unexpected = sorted(set(tensors) - set(own))
    missing = sorted(set(own) - set(tensors) - OPTIONAL_KEYS)
    if unexpected or missing:
        raise UserError(f"{path / WEIGHTS_FILE} does not fit its config: unexpected {unexpected[:3]}, missing {missing[:3]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise UserError(f"{path / WEIGHTS_FILE}: {name} has shape {tuple(tensor.shape)}, config needs "
                            f"{tuple(own[name].shape)}")
    if config.has_vocab_map and not OPTIONAL_KEYS <= set(tensors):
        raise UserError(f"{path / WEIGHTS_FILE} lacks d2t/t2d although draft_vocab_size < target vocab")
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=False)
    draft.float().eval()
    spec = config_json.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    return ExportedDraft(
        path=path, draft=draft, config_json=config_json,
        speculative_tokens=int(methods[0].get("speculative_tokens") or 1),
        verifier=str((spec.get("verifier") or {}).get("name_or_path") or ""),
        provenance=provenance,
    )
