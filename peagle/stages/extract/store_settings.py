"""The target as extract sees it before loading weights: config, tokenizer, and the identity that
goes into the store (docs/store.md: path, content hash, architecture, sizes, dtype; tokenizer
fingerprint; chat-template hash), from which ``StoreSettings`` are built."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle.model import target as T
from peagle.model.target import load_config
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig, resolve_aux_layer_ids
from peagle.stages.extract.mask_token import choose_mask_token

@dataclass(frozen=True, kw_only=True)
class Target:
    """What the driver knows about the target before loading its weights."""

    path: Path
    config: Any  # transformers PretrainedConfig (text part; peagle.model.target.load_config)
    tokenizer: Any


def load_target(path: str) -> Target:
    """Config and tokenizer of the target (weights are loaded later, by the backend).

    Raises:
        UserError: the directory is missing or holds no loadable config/tokenizer.
    """
    config = load_config(path)  # checks the directory first: a typo fails fast
    root = Path(path)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(root)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"cannot load target {root}: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}") from err
    return Target(path=root, config=config, tokenizer=tokenizer)


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


def store_settings(config: ExtractConfig, target: Target) -> S.StoreSettings:
    """The settings this run writes with (a pure function of the config and the target, so every
    worker of a store derives the same ones).

    Raises:
        UserError: bad aux layers for this target, or no usable mask token (``choose_mask_token``).
    """
    aux_ids = resolve_aux_layer_ids(config, target.config.num_hidden_layers)
    mask = choose_mask_token(target.tokenizer, int(target.config.vocab_size), config.mask_token_id)
    identity = T.Target(path=target.path, config=target.config).identity(compute_dtype(config))
    return S.StoreSettings(
        target=identity, tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer),
        chat_template_hash=hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest(),
        aux_layer_ids=aux_ids, topk=config.topk, max_seq_len=config.max_seq_len,
        logprob_dtype=config.logprob_dtype, loss_on=config.loss_on, mask_token_id=mask.token_id,
        mask_token=mask.token, mask_token_source=mask.source, supervise_reasoning=config.supervise_reasoning,
        hidden_dtype=config.hidden_dtype,
        regenerate=({"temperature": config.temperature, "top_p": config.top_p,
                     "max_new_tokens": config.max_new_tokens, "seed": config.seed} if config.regenerate else {}))
