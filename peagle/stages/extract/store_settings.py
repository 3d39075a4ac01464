"""The settings an extraction writes with (``StoreSettings``, docs/store.md), from its config and the
opened target (``peagle.model.target.TargetDirectory``: config, tokenizer, identity): the target's
identity, tokenizer fingerprint and chat-template hash, the aux layers and the mask token; and the
backend and compute dtype a run resolves to."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from typing import Any

from peagle.model.target import TargetDirectory
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig, resolve_aux_layer_ids
from peagle.stages.extract.mask_token import choose_mask_token


def tokenizer_fingerprint(tokenizer: Any) -> str:
    if getattr(tokenizer, "is_fast", False):
        return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def resolve_backend_name(backend: str) -> str:
    """``auto`` is vllm when ``import vllm`` works (a broken install falls back to hf), else hf."""
    if backend == "auto":
        if importlib.util.find_spec("vllm") is None:
            return "hf"
        try:
            import vllm  # noqa: F401  (a CPU box with a half-installed vllm must still extract)
        except Exception:
            return "hf"
        return "vllm"
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError("--backend vllm was asked for, but vllm is not installed (pip install peagle[vllm]; "
                        "or use --backend hf)")
    return backend


def compute_dtype(config: ExtractConfig) -> str:
    """The dtype that goes into the store identity: ``auto`` is bfloat16 on GPU, float32 on CPU."""
    if config.dtype != "auto":
        return config.dtype
    import torch

    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return "bfloat16" if on_gpu else "float32"


def store_settings(config: ExtractConfig, target: TargetDirectory) -> S.StoreSettings:
    """The settings this run writes with (a pure function of the config and the target, so every
    worker of a store derives the same ones).

    Raises:
        UserError: bad aux layers for this target, an unloadable tokenizer, or no usable mask token
            (``choose_mask_token``).
    """
    aux_ids = resolve_aux_layer_ids(config, target.config.num_hidden_layers)
    mask = choose_mask_token(target.tokenizer, int(target.config.vocab_size), config.mask_token_id)
    identity = target.identity(compute_dtype(config))
    return S.StoreSettings(
        target=identity, tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer),
        chat_template_hash=hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest(),
        aux_layer_ids=aux_ids, topk=config.topk, max_seq_len=config.max_seq_len,
        logprob_dtype=config.logprob_dtype, loss_on=config.loss_on, mask_token_id=mask.token_id,
        mask_token=mask.token, mask_token_source=mask.source, supervise_reasoning=config.supervise_reasoning,
        hidden_dtype=config.hidden_dtype,
        regenerate=({"temperature": config.temperature, "top_p": config.top_p,
                     "max_new_tokens": config.max_new_tokens, "seed": config.seed} if config.regenerate else {}))
