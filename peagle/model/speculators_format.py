"""The speculators checkpoint format (docs/draft-and-export.md): the one module that writes and reads it.

An export directory holds ``config.json`` and ``model.safetensors`` (or its shards and index:
``peagle export --max-file-mib``, peagle/pipeline/weight_files.py), as speculators model type
'peagle' (a P-EAGLE draft) or 'eagle3' (an EAGLE-3 draft; no ``mask_hidden``, no mask token). vLLM
loads it unchanged with ``LLM(model=EXPORT_DIR)``: it reads the verifier named inside and drafts in
parallel (peagle) or one token per forward (eagle3); the ``speculators`` library loads it with
``PEagleDraftModel`` / ``Eagle3DraftModel.from_pretrained``.

Write side: :data:`KEY_MAP` (draft state-dict key -> checkpoint key), :func:`expected_shapes`,
:func:`export_state_dict`, ``build_config`` and :func:`write_export` (atomic directory;
``peagle export``). Read side: ``draft_config_from_speculators`` (config.json -> DraftConfig),
:func:`load_export` (a whole draft: ``peagle eval``) and :func:`load_weights_into` (the tensors that
fit another draft: ``peagle train --init-from``). Both sides check keys and shapes against
:func:`expected_shapes`, so what one writes the other reads. config.json's two directions live in
peagle/model/speculators_config.py (re-exported here).

What was verified against speculators 0.9.0 and vLLM 0.32 (read from the installed packages, not
from memory), and how: docs/draft-and-export.md, "What the format was checked against".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.model.export_provenance import moved_config, portable_provenance, recorded_path
from peagle.model.speculators_config import (ARCHITECTURE, CONFIG_JSON, PROVENANCE_KEY,  # noqa: F401
                                             SPECULATORS_MODEL_TYPES, SPECULATORS_VERSION, VARIANT_FLAGS,
                                             build_config, check_export_config, check_recorded_draft_config,
                                             draft_config_from_speculators, read_config_file, variant_of)
from peagle.pipeline.atomic import atomic_dir, canonical_json
from peagle.pipeline.failpoints import failpoint
from peagle.pipeline.weight_files import (WEIGHTS_FILE, WEIGHTS_INDEX_FILE, has_weights, is_weights_file_name,
                                          load_tensors, save_tensors, weights_entry)
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError

CONFIG_FILE = CONFIG_JSON

# peagle's PEagleDraft state-dict key -> the speculators/vLLM checkpoint key. ``{i}`` is any layer
# index (any aux index in ``fc_norm``); ``layers.0.hidden_norm`` exists on layer 0 only, q/k norms
# in qwen3 drafts, ``input_norm`` and ``fc_norm`` with norm_before_fc / fc_norm (vLLM's names). The names were chosen equal, so the map is
# an identity on purpose: it is written out so a rename on either side fails a test, not a load.
KEY_MAP: dict[str, str] = {
    "embed_tokens.weight": "embed_tokens.weight",
    "fc.weight": "fc.weight",
    "input_norm.weight": "input_norm.weight",
    "fc_norm.{i}.weight": "fc_norm.{i}.weight",
    "layers.0.hidden_norm.weight": "layers.0.hidden_norm.weight",
    "layers.{i}.input_layernorm.weight": "layers.{i}.input_layernorm.weight",
    "layers.{i}.self_attn.q_proj.weight": "layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.self_attn.k_proj.weight": "layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.v_proj.weight": "layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.o_proj.weight": "layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.self_attn.q_norm.weight": "layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "layers.{i}.self_attn.k_norm.weight",
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
    }
    if config.method == "peagle":
        shapes["mask_hidden"] = (1, 1, A * T)
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
        if config.architecture == "qwen3":
            shapes[f"layers.{i}.self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"layers.{i}.self_attn.k_norm.weight"] = (config.head_dim,)
    if config.norm_before_fc:
        shapes["input_norm.weight"] = (A * T,)
    if config.fc_norm:
        shapes.update({f"fc_norm.{j}.weight": (T,) for j in range(A)})
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
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        key = export_key(name)
        if key is None:
            raise UserError(f"checkpoint key {name!r} has no place in the speculators format; "
                            "was it written by another peagle version?")
        if key in VOCAB_MAP_KEYS and not config.has_vocab_map:
            continue
        tensor = tensor.detach().cpu()
        if key in VOCAB_MAP_KEYS:
            tensor = tensor.to(torch.int64 if key == "d2t" else torch.bool)
        elif tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[key] = tensor.contiguous()
    check_tensors(out, config, "checkpoint")
    return out


def check_tensors(tensors: dict[str, Tensor], config: DraftConfig, where: str) -> None:
    """Raise one UserError unless ``tensors`` (checkpoint keys) are exactly :func:`expected_shapes`."""
    expected = expected_shapes(config)
    unexpected, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if unexpected:
        raise UserError(f"{where}: {unexpected[0]!r} does not fit the draft config ({config.architecture}, "
                        f"{config.num_layers} layers, draft vocab {config.draft_vocab_size} of {config.target_vocab_size}"
                        f"{''.join(f', {n}' for n in ('norm_before_fc', 'fc_norm') if getattr(config, n))})")
    if missing:
        raise UserError(f"{where} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} of the speculators format")
    for key, tensor in tensors.items():
        if tuple(tensor.shape) != expected[key]:
            raise UserError(f"{where}: {key} has shape {tuple(tensor.shape)}, the draft config needs {expected[key]}")


# --------------------------------------------------------------------------------------------------
# Writing


def write_export(state_dict: dict[str, Tensor], draft_config: DraftConfig, out: str | os.PathLike, *,
                 verifier_name: str, verifier_architectures: list[str], speculative_tokens: int,
                 dtype: torch.dtype = torch.float32, provenance: dict[str, Any] | None = None,
                 max_file_bytes: int | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` to ``out`` as one atomic directory (temp dir,
    fsync, rename); an existing export there is replaced whole. With ``max_file_bytes``, weights
    larger than that are written as shards and their index (:mod:`peagle.pipeline.weight_files`).

    Raises:
        UserError: ``out`` holds something that is not an export, or the state dict does not fit
            the format (:func:`export_state_dict`).
    """
    tensors = export_state_dict(state_dict, draft_config, dtype=dtype)
    config_json = build_config(draft_config, verifier_name=verifier_name, verifier_architectures=verifier_architectures,
                               speculative_tokens=speculative_tokens, dtype=str(dtype).removeprefix("torch."),
                               provenance=None if provenance is None else portable_provenance(provenance, out))
    out = Path(out)
    # an export is replaced whole, a damaged one too (it holds an export's files and nothing else)
    if out.exists() and any(out.iterdir()) and not (is_export_dir(out) or holds_only_export_files(out)):
        raise UserError(f"--out {out} exists and is not a peagle export; choose an empty or new directory")
    with atomic_dir(out) as tmp:
        save_tensors(tensors, tmp, max_file_bytes=max_file_bytes, metadata={"format": "pt"})
        failpoint("export.write")  # the weights written under the temp name, config.json not yet
        (tmp / CONFIG_FILE).write_bytes(canonical_json(config_json))
    return out


# --------------------------------------------------------------------------------------------------
# Reading


def is_export_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a readable config.json of a speculators draft (its values unchecked)."""
    with contextlib.suppress(OSError, json.JSONDecodeError, AttributeError):
        return json.loads((Path(path) / CONFIG_FILE).read_text()).get("speculators_model_type") in SPECULATORS_MODEL_TYPES
    return False


def holds_only_export_files(path: str | os.PathLike) -> bool:
    """Whether every entry of ``path`` is a file an export has (a damaged export, which a new one may replace)."""
    return all(p.is_file() and (p.name in (CONFIG_FILE, EMBEDDING_RECORD) or is_weights_file_name(p.name))
               for p in Path(path).iterdir())


def looks_like_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds an export's config.json and weights (one file or an index), whatever their
    content: a reader that finds them reads the directory as an export (:func:`read_export_config`), so
    a damaged config.json is named as such, not taken for something else (a checkpoint, a run)."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and has_weights(path)


def read_export_config(path: str | os.PathLike) -> dict[str, Any]:
    """An export directory's config.json, every field a reader uses checked (``check_export_config``).

    Raises:
        UserError: one line naming the file and the fault: a file of the export missing, config.json
            unreadable, cut short, or with a field missing or out of range.
    """
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not has_weights(path):
        raise UserError(f"{path} is not an export directory (needs {CONFIG_FILE} and {WEIGHTS_FILE} "
                        f"or {WEIGHTS_INDEX_FILE})")
    config_json = read_config_file(path / CONFIG_FILE)
    draft_config_from_speculators(config_json, str(path / CONFIG_FILE))  # checks every field the readers use
    return config_json


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

    def recorded_path(self, text: str) -> Path:
        """A path the ``peagle`` section records, as a path here (:func:`recorded_path`)."""
        return recorded_path(self.path, self.provenance, text)


def load_export(path: str | os.PathLike) -> ExportedDraft:
    """An export directory as a PEagleDraft (fp32, eval mode), every key and shape checked.

    The draft's shape comes from the speculators fields of config.json (so a speculators-trained
    P-EAGLE or EAGLE-3 checkpoint loads too) and, for peagle exports, must agree with the ``peagle.draft_config``
    provenance section.

    Raises:
        UserError: when the directory is not a 'peagle' or 'eagle3' export or its tensors do not fit its config.
    """
    path = Path(path)
    config_json = read_export_config(path)
    config = draft_config_from_speculators(config_json, str(path / CONFIG_FILE))
    tensors = load_tensors(path)
    provenance = config_json.get(PROVENANCE_KEY) or {}
    check_recorded_draft_config(provenance, config, path / CONFIG_FILE)
    check_tensors(tensors, config, str(path / weights_entry(path)))
    draft = PEagleDraft(config)
    own = draft.state_dict()
    by_key = {export_key(name): name for name in own}
    draft.load_state_dict({by_key[k]: v.to(own[by_key[k]].dtype) for k, v in tensors.items()}, strict=False)
    draft.float().eval()
    spec = config_json.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    return ExportedDraft(path=path, draft=draft, config_json=config_json,
                         speculative_tokens=int(methods[0]["speculative_tokens"]),
                         verifier=str((spec.get("verifier") or {}).get("name_or_path") or ""), provenance=provenance)


def load_weights_into(draft: PEagleDraft, export_dir: str | os.PathLike) -> str:
    """Copy the tensors of an exported P-EAGLE / EAGLE-3 draft that fit ``draft`` (warm start).

    Tensors whose key and shape match are copied; the draft vocab must be the same one (``d2t``).
    Keys the export lacks (an EAGLE-3 draft has no ``mask_hidden``; fewer layers) keep their values
    and are named in the returned summary line. The export must be the same variant (decoder type
    and norm options, :func:`check_same_variant`): a warm start continues a draft, never changes it.

    Raises:
        UserError: missing files, another variant, a shape that differs, or another draft vocab.
    """
    if not has_weights(export_dir):
        raise UserError(f"--init-from {export_dir}: no {WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE}) there (expected a "
                        "`peagle export` or speculators draft directory)")
    tensors = load_tensors(Path(export_dir))
    check_same_variant(draft.config, export_dir, tensors)
    own = draft.state_dict()
    if "d2t" in tensors and "d2t" in own and not torch.equal(tensors["d2t"].long(), own["d2t"].long().cpu()):
        raise UserError(f"--init-from {export_dir} was trained with another draft vocab (d2t differs); "
                        "use the same --draft-vocab-size and store vocab")
    loaded, kept = [], []
    with torch.no_grad():
        for name, value in own.items():
            key = export_key(name)
            if key in VOCAB_MAP_KEYS:
                continue
            if key not in tensors:
                kept.append(name)
                continue
            if tuple(tensors[key].shape) != tuple(value.shape):
                raise UserError(f"--init-from {export_dir}: {key} has shape {tuple(tensors[key].shape)}, this "
                                f"draft's is {tuple(value.shape)}")
            value.copy_(tensors[key].to(value.dtype))
            loaded.append(name)
    summary = f"warm start from {export_dir}: {len(loaded)} tensors loaded"
    if kept:
        summary += f"; {len(kept)} kept at init ({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})"
    return summary


_VARIANT_KEYS = {"architecture": re.compile(r"^layers\.\d+\.self_attn\.[qk]_norm\.weight$"),
                 "norm_before_fc": re.compile(r"^input_norm\.weight$"), "fc_norm": re.compile(r"^fc_norm\.\d+\.weight$")}


def check_same_variant(config: DraftConfig, export_dir: str | os.PathLike, tensors: dict[str, Tensor]) -> None:
    """Refuse, in one line naming the flag, an export of another variant than ``config``: what its
    config.json states (when it has a speculators one), and any variant tensor ``config`` has no place for."""
    config_json: Any = {}
    if (Path(export_dir) / CONFIG_FILE).is_file():  # a bare weights directory states nothing
        config_json = read_config_file(Path(export_dir) / CONFIG_FILE)
    speculators = isinstance(config_json, dict) and "speculators_model_type" in config_json
    if speculators:  # a damaged or out-of-range speculators config is refused, naming the field
        draft_config_from_speculators(config_json, str(Path(export_dir) / CONFIG_FILE))
    stated = variant_of(config_json) if speculators else {}
    differ = [(name, stated[name]) for name in VARIANT_FLAGS if name in stated and getattr(config, name) != stated[name]]
    if differ:  # every differing flag at once: a draft from before the norm defaults differs in three
        wanted = " ".join(f"{VARIANT_FLAGS[name]} {value}" if name == "architecture" else VARIANT_FLAGS[name] if value
                          else f"--no-{VARIANT_FLAGS[name][2:]}" for name, value in differ)
        states = ", ".join(f"{name}={value}" for name, value in differ)
        raise UserError(f"--init-from {export_dir} was trained with {wanted} ({states}; this run differs); pass "
                        f"{wanted}: a warm start keeps the draft's variant")
    has = {"architecture": config.architecture == "qwen3", "norm_before_fc": config.norm_before_fc,
           "fc_norm": config.fc_norm}
    foreign = sorted(key for key in tensors for name, pattern in _VARIANT_KEYS.items()
                     if not has[name] and pattern.match(key))
    if foreign:
        raise UserError(f"--init-from {export_dir} has {foreign[0]!r}, which this run's draft lacks; pass the "
                        "--draft-architecture / --norm-before-fc / --fc-norm it was trained with")


# --------------------------------------------------------------------------------------------------
# Moving an export without the target's embedding

TARGET_EMBEDDING_KEY = "embed_tokens.weight"
EMBEDDING_RECORD = "target_embedding.json"
"""Beside an export written without its embedding: the tensor's shape, dtype and sha256."""


def _tensor_sha256(tensor: Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def without_target_embedding(export_dir: str | os.PathLike, out: str | os.PathLike, *,
                             max_file_bytes: int | None = None) -> Path:
    """A copy of an export without ``embed_tokens`` (a draft trained with ``--no-train-embeddings``
    keeps the target's rows, which are most of a small draft's bytes), and a record of what was left
    out, so :func:`with_target_embedding` can put back exactly those bytes from the target. With
    ``max_file_bytes``, weights larger than that are written as shards (a draft git holds).

    Raises:
        UserError: ``export_dir`` is not an export.
    """
    config_json = moved_config(read_export_config(export_dir), export_dir, out)
    tensors = load_tensors(Path(export_dir))
    embedding = tensors.pop(TARGET_EMBEDDING_KEY)
    record = {"key": TARGET_EMBEDDING_KEY, "shape": list(embedding.shape), "dtype": str(embedding.dtype).removeprefix("torch."),
              "sha256": _tensor_sha256(embedding)}
    with atomic_dir(Path(out)) as tmp:
        save_tensors(tensors, tmp, max_file_bytes=max_file_bytes, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_bytes(canonical_json(config_json))
        (tmp / EMBEDDING_RECORD).write_bytes(canonical_json(record))
    return Path(out)


def read_embedding_record(file: Path) -> dict[str, Any]:
    """The record of a left-out embedding (:data:`EMBEDDING_RECORD`), every field checked.

    Raises:
        UserError: one line naming the file and the field.
    """
    record = read_config_file(file)
    if not isinstance(record, dict):
        raise UserError(f"{file}: holds a JSON {type(record).__name__}, not an object")
    dtype = record.get("dtype")
    for name, fine in (("key", record.get("key") == TARGET_EMBEDDING_KEY),
                       ("shape", isinstance(record.get("shape"), list) and len(record["shape"]) == 2
                        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in record["shape"])),
                       ("dtype", isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)),
                       ("sha256", isinstance(record.get("sha256"), str) and len(record["sha256"]) == 64)):
        if not fine:
            raise UserError(f"{file}: {name} is {record.get(name)!r}, not what `peagle export` records; export "
                            "the checkpoint again")
    return record


def with_target_embedding(stripped_dir: str | os.PathLike, target_dir: str | os.PathLike,
                          out: str | os.PathLike) -> Path:
    """The whole export again: ``stripped_dir``'s tensors plus the target's embedding, cast to the
    recorded dtype and checked against the recorded sha256 (another target, or the same weights
    dequantized differently, is refused rather than served with rows the draft never saw). Its
    verifier becomes ``target_dir``: the target it was made whole with is the one to serve it with,
    so a travelling export may name its target by any name (the committed drafts name the hub's).

    Raises:
        UserError: no record, the target has no unique embedding, or its bytes differ.
    """
    from peagle.model.target.directory import TargetWeights

    stripped = Path(stripped_dir)
    if not (stripped / EMBEDDING_RECORD).is_file():
        raise UserError(f"{stripped / EMBEDDING_RECORD} is missing or unreadable (no such file): {stripped} is not "
                        "an export written without its embedding")
    record = read_embedding_record(stripped / EMBEDDING_RECORD)
    config_json = moved_config(read_export_config(stripped), stripped, out)
    tensors = load_tensors(stripped)
    weights = TargetWeights(target_dir)
    key = weights.find(TARGET_EMBEDDING_KEY)
    if key is None:
        raise UserError(f"target {target_dir} has no unique {TARGET_EMBEDDING_KEY}")
    embedding = weights.read(key).to(getattr(torch, record["dtype"]))
    if list(embedding.shape) != record["shape"] or _tensor_sha256(embedding) != record["sha256"]:
        raise UserError(f"target {target_dir}'s {TARGET_EMBEDDING_KEY} ({list(embedding.shape)}, {record['dtype']}) is "
                        f"not the one {stripped} was trained with (sha256 differs): restore it from the same target")
    tensors[record["key"]] = embedding
    spec = config_json.get("speculators_config")
    if isinstance(spec, dict) and isinstance(spec.get("verifier"), dict):
        config_json = {**config_json, "speculators_config": {
            **spec, "verifier": {**spec["verifier"], "name_or_path": os.path.abspath(target_dir)}}}
    check_tensors(tensors, draft_config_from_speculators(config_json, str(stripped / CONFIG_FILE)),
                  str(stripped / weights_entry(stripped)))
    with atomic_dir(Path(out)) as tmp:
        save_tensors(tensors, tmp, metadata={"format": "pt"})  # made whole here, to serve: one file
        (tmp / CONFIG_FILE).write_bytes(canonical_json(config_json))
    return Path(out)
