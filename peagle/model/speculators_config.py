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
import json
from pathlib import Path
from typing import Any

from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError
from peagle.schemas.speculative_schedule import SCHEDULE_KEY, Schedule, check_schedule

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

CONFIG_JSON = "config.json"

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


REQUIRED_LAYER_SIZES = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")
"""``transformer_layer_config`` sizes a draft cannot be built without (positive integers)."""
OPTIONAL_LAYER_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "num_aux_hidden_states")
OPTIONAL_TOP_SIZES = ("draft_vocab_size", "target_hidden_size", "num_aux_hidden_states")
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def check_export_config(config_json: Any, where: str) -> None:
    """Refuse, in one line naming ``where`` (the file) and the field, a config.json a draft cannot be
    read from: a missing or mistyped field, a size below 1, K (``speculative_tokens``) below 1, a mask
    token outside the vocab, or a DraftConfig that refuses the values.

    Why here: every reader of an export (eval, the demo, ``peagle export`` of a stripped export,
    ``--init-from``) goes through :func:`draft_config_from_speculators` or ``read_export_config``, so a
    damaged export is one line wherever it is read, never a KeyError from deep inside a reader.

    Raises:
        UserError: the first fault found.
    """
    def refuse(field: str, fault: str) -> UserError:
        return UserError(f"{where}: {field} {fault}; export the checkpoint again (`peagle export`)")

    if not isinstance(config_json, dict):
        raise refuse("the file", f"holds a JSON {type(config_json).__name__}, not an object")
    method = config_json.get("speculators_model_type")
    if method not in SPECULATORS_MODEL_TYPES:
        raise UserError(f"{where}: not a speculators 'peagle' or 'eagle3' checkpoint (speculators_model_type="
                        f"{method!r})")
    layer = config_json.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise refuse("transformer_layer_config", "is missing" if layer is None else "is not an object")
    for name in REQUIRED_LAYER_SIZES:
        _check_size(layer.get(name), f"transformer_layer_config.{name}", refuse, required=True)
    for name in OPTIONAL_LAYER_SIZES:
        _check_size(layer.get(name), f"transformer_layer_config.{name}", refuse, required=False)
    for name in OPTIONAL_TOP_SIZES:
        _check_size(config_json.get(name), name, refuse, required=False)
    for name, bound in (("rms_norm_eps", layer.get("rms_norm_eps")), ("rope_theta", layer.get("rope_theta"))):
        if bound is not None and (not _is_number(bound) or bound <= 0):
            raise refuse(f"transformer_layer_config.{name}", f"is {bound!r}, not a positive number")
    rope = layer.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise refuse("transformer_layer_config.rope_parameters", f"is {rope!r}, not an object")
    for name in FLAGS:
        if name in config_json and not isinstance(config_json[name], bool):
            raise refuse(name, f"is {config_json[name]!r}, not true or false")
    ids = config_json.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(i) and i >= 0 for i in ids)):
        raise refuse("eagle_aux_hidden_state_layer_ids", f"is {ids!r}, not a list of layer indices")
    vocab = layer["vocab_size"]
    if (config_json.get("draft_vocab_size") or vocab) > vocab:
        raise refuse("draft_vocab_size", f"{config_json['draft_vocab_size']} exceeds the vocab_size {vocab}")
    mask = config_json.get("mask_token_id")
    if method == "peagle" and not (_is_int(mask) and 0 <= mask < vocab):
        raise refuse("mask_token_id", "is missing" if mask is None else f"is {mask!r}, not a token id below {vocab}")
    spec = config_json.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not (isinstance(methods, list) and methods and isinstance(methods[0], dict)):
        raise refuse("speculators_config.proposal_methods", "is missing or empty")
    k = methods[0].get("speculative_tokens")
    if not _is_int(k) or k < 1:
        raise refuse("speculators_config.proposal_methods[0].speculative_tokens",
                      f"is {k!r}; K, the draft tokens proposed per step, must be an integer >= 1")
    verifier = spec.get("verifier")
    if verifier is not None and not (isinstance(verifier, dict)
                                     and isinstance(verifier.get("name_or_path", ""), str)):
        raise refuse("speculators_config.verifier", f"is {verifier!r}, not an object with a name_or_path")
    section = config_json.get(PROVENANCE_KEY)
    if isinstance(section, dict) and section.get(SCHEDULE_KEY) is not None:
        check_schedule(section[SCHEDULE_KEY], speculative_tokens=k, parallel=method == "peagle",
                       where=f"{where} ({PROVENANCE_KEY}.{SCHEDULE_KEY})")


def recorded_schedule(config_json: dict[str, Any]) -> Schedule | None:
    """The batch-size schedule of K an export carries (peagle/schemas/speculative_schedule.py), checked
    with the rest of config.json by :func:`check_export_config`; None when it carries none."""
    section = config_json.get(PROVENANCE_KEY)
    schedule = section.get(SCHEDULE_KEY) if isinstance(section, dict) else None
    return [list(entry) for entry in schedule] if schedule is not None else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_size(value: Any, field: str, refuse: Any, *, required: bool) -> None:
    if value is None:
        if required:
            raise refuse(field, "is missing")
        return
    if not _is_int(value) or value < 1:
        raise refuse(field, f"is {value!r}, not an integer >= 1")


def draft_config_from_speculators(config_json: dict[str, Any], where: str = CONFIG_JSON) -> DraftConfig:
    """The DraftConfig a speculators 'peagle' or 'eagle3' config.json describes (``where``: the file,
    for the error lines).

    Raises:
        UserError: for a config this draft model cannot represent, naming ``where`` and the field
            (:func:`check_export_config`).
    """
    check_export_config(config_json, where)
    method = config_json["speculators_model_type"]
    # vLLM's defaults where the config is silent: update_peagle reads norm_before_residual as False,
    # update_eagle3 as True.
    variant = {"norm_before_residual": method == "eagle3", "norm_before_fc": False, **variant_of(config_json)}
    layer = config_json["transformer_layer_config"]
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    aux_ids = list(config_json.get("eagle_aux_hidden_state_layer_ids") or [])
    num_aux = int(layer.get("num_aux_hidden_states") or config_json.get("num_aux_hidden_states") or len(aux_ids) or 3)
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(layer.get("rope_theta", 10000.0))}
    try:
        return DraftConfig(
            hidden_size=hidden, num_heads=heads, num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_parameters=dict(rope),
            num_layers=int(layer["num_hidden_layers"]),
            target_hidden_size=int(config_json.get("target_hidden_size") or hidden),
            num_aux=num_aux, target_vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(config_json.get("draft_vocab_size") or layer["vocab_size"]),
            mask_token_id=int(config_json["mask_token_id"]) if method == "peagle" else None, method=method,
            max_position_embeddings=int(layer.get("max_position_embeddings", 4096)), aux_layer_ids=aux_ids, **variant,
        )
    except UserError as err:  # DraftConfig's own checks (heads vs kv heads, aux ids vs num_aux, rope type)
        raise UserError(f"{where}: {err}; export the checkpoint again (`peagle export`)") from err


def read_config_file(file: Path) -> Any:
    """The JSON in ``file``, or one line naming it and why it does not parse (a cut-short file)."""
    try:
        text = file.read_bytes()
    except OSError as err:
        raise UserError(f"{file} is unreadable ({err.strerror or err})") from err
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        # an unterminated string runs to the end of the file too (its error points at its start)
        cut = isinstance(err, json.JSONDecodeError) and (err.pos >= len(text.rstrip())
                                                         or err.msg.startswith("Unterminated string"))
        fault = f"ends after {len(text)} bytes, before its JSON does (cut short?)" if cut else f"is not valid JSON ({err})"
        raise UserError(f"{file} {fault}; export the checkpoint again (`peagle export`)") from err


def check_recorded_draft_config(provenance: Any, config: DraftConfig, file: Path) -> None:
    """The ``peagle.draft_config`` section, where a peagle export has one, must state the draft the
    speculators fields describe (a hand edit of one and not the other would serve another draft than
    the one measured).

    Raises:
        UserError: one line naming the file and the first field that differs, with both values.
    """
    recorded = provenance.get("draft_config") if isinstance(provenance, dict) else None
    if recorded is None:
        return
    if not isinstance(recorded, dict):
        raise UserError(f"{file}: {PROVENANCE_KEY}.draft_config is not an object; export the checkpoint again")
    try:
        stated = DraftConfig.from_dict(recorded).to_dict()
    except (UserError, TypeError, ValueError) as err:
        raise UserError(f"{file}: {PROVENANCE_KEY}.draft_config: {err}; export the checkpoint again") from err
    held = config.to_dict()
    differ = sorted(k for k in set(stated) | set(held) if stated.get(k) != held.get(k))
    if differ:
        k = differ[0]
        raise UserError(f"{file}: the speculators fields and {PROVENANCE_KEY}.draft_config disagree on {k} "
                        f"({held.get(k)!r} vs {stated.get(k)!r}); export the checkpoint again")
