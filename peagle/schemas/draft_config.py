"""The draft model's shape: everything needed to build a `PEagleDraft` and to export it (docs/draft-and-export.md).

The decoder is Llama-shaped or Qwen3-shaped (``architecture``: the two decoder types vLLM 0.32's
P-EAGLE loader serves; Qwen3 adds RMSNorms on each query and key head before RoPE), with hidden
size, heads, head dim, RoPE and RMS eps copied from the target so that `embed_tokens` and `lm_head`
rows can be taken from it. The EAGLE-3.1 norm options (``norm_before_residual``, ``norm_before_fc``,
``fc_norm``) are the ones vLLM applies in a parallel-drafting forward (docs/draft-and-export.md).
Plain data: JSON in and out.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from peagle.schemas.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

DRAFT_METHODS = ("peagle", "eagle3")
"""How a draft proposes its K tokens (docs/methods.md): ``peagle`` all K in one forward (mask slots),
``eagle3`` one per forward, each forward reading the previous one's hidden state."""
METHOD_NAMES = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3 with training-time test"}
"""What the trainer and the demo call each method in their output."""

DRAFT_ARCHITECTURES = ("llama", "qwen3")
"""Decoder types: the ``transformer_layer_config.model_type`` values vLLM 0.32 maps to a P-EAGLE
model (``PeagleLlamaForCausalLM`` -> llama_eagle3.py, ``PeagleQwen3ForCausalLM`` -> qwen3_eagle3.py)."""


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """``[2, N//2, N-3]``: EAGLE-3's choice (low, middle, high) for an N-layer target."""
    return [2, num_target_layers // 2, num_target_layers - 3]


@dataclass(kw_only=True)
class DraftConfig:
    """Shape, vocabulary and drafting method of a draft (P-EAGLE or EAGLE-3)."""

    hidden_size: int
    """Draft hidden size H (= the target's, so embeddings and lm_head rows can be copied)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    """As transformers 5 ``config.rope_parameters``: ``rope_type``, ``rope_theta`` and its scaling keys."""
    num_layers: int = 4
    """Decoder layers: layer 0 (2H-wide attention input) plus num_layers - 1 plain Llama layers."""
    target_hidden_size: int
    num_aux: int
    """A: how many target layers feed the draft (len(aux_layer_ids)); fc maps A*target_hidden -> H."""
    target_vocab_size: int
    draft_vocab_size: int
    mask_token_id: int | None = None
    """Target-vocab id embedded at every mask slot (depth >= 1) of a P-EAGLE draft (vLLM's
    ``pard_token``; the store's choice); None for an EAGLE-3 draft, which has no mask slots."""
    max_position_embeddings: int
    aux_layer_ids: list[int]
    """Target layers whose entering hidden stream is an aux state (HF hidden_states index)."""
    method: str = "peagle"
    """One of DRAFT_METHODS: ``peagle`` has ``mask_hidden`` and a ``mask_token_id`` and is exported for
    parallel drafting; ``eagle3`` has neither and is exported as an EAGLE-3 draft (sequential drafting)."""
    architecture: str = "llama"
    """Decoder type, one of DRAFT_ARCHITECTURES: ``qwen3`` adds ``q_norm``/``k_norm`` (RMSNorm over
    each head's D features, before RoPE) to every layer's attention, as Qwen3 and vLLM's qwen3_eagle3 do."""
    norm_before_residual: bool = False
    """Layer 0's residual is hidden_norm(fc(aux)) when True, fc(aux) when False (vLLM reads the
    same key; its P-EAGLE config loader assumes False when absent, so export must write it)."""
    norm_before_fc: bool = False
    """One RMSNorm (``input_norm``, A*T wide) over the concatenated aux states before ``fc``; vLLM's
    ``combine_hidden_states`` applies it to the aux rows and to ``mask_hidden`` alike."""
    fc_norm: bool = False
    """One RMSNorm per aux layer (``fc_norm.{j}``, T wide) on its chunk before ``fc`` (after
    ``input_norm`` when both are on, vLLM's order)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "num_layers", "target_hidden_size", "num_aux", "target_vocab_size",
                     "draft_vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise UserError(f"draft config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"draft config: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.draft_vocab_size > self.target_vocab_size:
            raise UserError(
                f"draft config: draft_vocab_size {self.draft_vocab_size} exceeds target_vocab_size "
                f"{self.target_vocab_size}"
            )
        if self.method not in DRAFT_METHODS:
            raise UserError(f"draft config: method {self.method!r} is not one of {'|'.join(DRAFT_METHODS)}")
        if self.method == "peagle" and self.mask_token_id is None:
            raise UserError("draft config: a P-EAGLE draft needs a mask_token_id (its mask slots' token)")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.target_vocab_size:
            raise UserError(
                f"draft config: mask_token_id {self.mask_token_id} is outside the target vocab "
                f"[0, {self.target_vocab_size})"
            )
        ids = list(self.aux_layer_ids)
        if len(ids) != self.num_aux:
            raise UserError(f"draft config: {len(ids)} aux_layer_ids {ids} but num_aux is {self.num_aux}")
        if any(b <= a for a, b in zip(ids, ids[1:])) or any(i < 0 for i in ids):
            raise UserError(f"draft config: aux_layer_ids {ids} must be non-negative and strictly ascending")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UserError(
                f"draft config: rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.architecture not in DRAFT_ARCHITECTURES:
            raise UserError(f"draft config: architecture {self.architecture!r} is not one of "
                            f"{'|'.join(DRAFT_ARCHITECTURES)}")
        if "rope_theta" not in self.rope_parameters:
            raise UserError(f"draft config: rope_parameters {self.rope_parameters} has no rope_theta")

    @classmethod
    def from_target_config(
        cls,
        hf_config: Any,
        *,
        num_layers: int = 4,
        draft_vocab_size: int | None = None,
        mask_token_id: int | None,
        aux_layer_ids: list[int] | None = None,
        method: str = "peagle",
        architecture: str = "llama",
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
    ) -> "DraftConfig":
        """Derive a draft config from a transformers target config (text config of multimodal ones).

        ``draft_vocab_size`` None means the full target vocab; ``aux_layer_ids`` None means
        `default_aux_layer_ids`. Ids may go up to num_hidden_layers (the final stream, docs/store.md).
        """
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        num_target_layers = int(text.num_hidden_layers)
        ids = default_aux_layer_ids(num_target_layers) if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
        if any(i > num_target_layers for i in ids):
            raise UserError(f"aux_layer_ids {ids} exceed the target's {num_target_layers} layers")
        rope = getattr(text, "rope_parameters", None)
        if not rope or not isinstance(rope, dict) or "rope_theta" not in rope:
            raise UserError(
                f"target config has no flat rope_parameters with rope_theta (got {rope!r}); "
                "per-layer-type RoPE is not supported"
            )
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
        vocab = int(text.vocab_size)
        return cls(
            hidden_size=int(text.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(text.intermediate_size),
            rms_norm_eps=float(text.rms_norm_eps),
            rope_parameters=copy.deepcopy(dict(rope)),
            num_layers=num_layers,
            target_hidden_size=int(text.hidden_size),
            num_aux=len(ids),
            target_vocab_size=vocab,
            draft_vocab_size=vocab if draft_vocab_size is None else int(draft_vocab_size),
            mask_token_id=None if mask_token_id is None else int(mask_token_id),
            max_position_embeddings=int(text.max_position_embeddings),
            aux_layer_ids=ids,
            method=method,
            architecture=architecture,
            norm_before_residual=norm_before_residual,
            norm_before_fc=norm_before_fc,
            fc_norm=fc_norm,
        )

    @property
    def has_vocab_map(self) -> bool:
        """True when the draft vocab is a strict subset (export writes d2t/t2d only then)."""
        return self.draft_vocab_size != self.target_vocab_size

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (fresh copies: mutating it never changes the config)."""
        return copy.deepcopy(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DraftConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"draft config: unknown keys {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise UserError(f"draft config: missing keys {missing}")
        return cls(**copy.deepcopy(data))

    def llama_config_dict(self) -> dict[str, Any]:
        """The draft decoder as a transformers Llama config dict (speculators' transformer_layer_config)."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": copy.deepcopy(self.rope_parameters),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.target_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
        }

    def layer_config_dict(self) -> dict[str, Any]:
        """The draft decoder as a transformers config dict of its ``architecture`` (speculators'
        ``transformer_layer_config``, whose ``model_type`` picks vLLM's model class)."""
        config = self.llama_config_dict()
        if self.architecture == "qwen3":
            del config["mlp_bias"]  # a Llama-only field
            config.update({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False})
        return config
