"""The settings an extraction writes with (``StoreSettings``, docs/store.md), from its config and the
opened target (``peagle.model.target.directory.TargetDirectory``: config, tokenizer, identity): the target's
identity, tokenizer fingerprint and chat-template hash, the aux layers and the mask token; and the
compute dtype a run resolves to (which backend it runs: ``peagle.model.target.backend_choice``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from peagle.model.target.backend_choice import resolve_backend_name
from peagle.model.target.directory import TargetDirectory
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig, resolve_aux_layer_ids
from peagle.stages.extract.mask_token import choose_mask_token


def tokenizer_fingerprint(tokenizer: Any) -> str:
    if getattr(tokenizer, "is_fast", False):
        return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def on_gpu(config: ExtractConfig) -> bool:
    """Whether the target runs on a GPU (``--device cuda``, or ``auto`` with one visible)."""
    import torch

    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def compute_dtype(config: ExtractConfig) -> str:
    """The dtype that goes into the store identity: ``auto`` is bfloat16 on GPU, float32 on CPU."""
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if on_gpu(config) else "float32"


def check_tokenizer(target: TargetDirectory) -> None:
    """The target's tokenizer loads, is a fast one and has a chat template: what every record needs.

    Checked before the store exists, so that a target missing them fails naming the target, not
    record by record as if the input were bad, and leaves no store behind (docs/reliability.md).

    Raises:
        UserError: one line naming the target and what it lacks.
    """
    tokenizer = target.tokenizer  # load_tokenizer names a directory without tokenizer files
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"target {target.path}'s tokenizer is not a fast tokenizer (extract needs offset "
                        "mappings): give the target a tokenizer.json")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"target {target.path}'s tokenizer has no chat template (tokenizer_config.json: "
                        "chat_template, or chat_template.jinja); copy the model's chat template into it")


def regeneration_settings(config: ExtractConfig) -> dict[str, Any]:
    """What decides the text ``--regenerate`` writes, recorded in the store so that no two runs with
    different ones put their shards in one store: the sampling settings, the model dtype that writes
    the answers and, with the hf backend, the batches they are written in (each batch draws
    from its own seed; a run's ``auto`` batch size resolves on its machine, so a worker on another
    kind of machine is refused rather than silently writing other text)."""
    if not config.regenerate:
        return {}
    out: dict[str, Any] = {"temperature": config.temperature, "top_p": config.top_p,
                           "max_new_tokens": config.max_new_tokens, "seed": config.seed}
    out["generation_dtype"] = generation_dtype(config)
    if resolve_backend_name(config.backend) == "hf":
        out["generation_batch_size"] = config.generation_batch_size or (1024 if on_gpu(config) else 64)
    return out


def generation_dtype(config: ExtractConfig) -> str:
    """The dtype the target writes ``--regenerate``'s answers in, either backend (``auto``: bfloat16
    for a float32 target on a CPU with native bf16, else the compute dtype:
    :func:`peagle.model.target.hf_backend.resolve_generation_dtype`)."""
    import torch

    from peagle.model.target.hf_backend import resolve_generation_dtype

    compute = getattr(torch, compute_dtype(config))
    device = torch.device("cuda" if on_gpu(config) else "cpu")
    return str(resolve_generation_dtype(config.generation_dtype, compute, device)).removeprefix("torch.")


def store_settings(config: ExtractConfig, target: TargetDirectory) -> S.StoreSettings:
    """The settings this run writes with (a pure function of the config and the target, so every
    worker of a store derives the same ones).

    Raises:
        UserError: bad aux layers for this target, an unloadable tokenizer or one without a chat
            template (``check_tokenizer``), or no usable mask token (``choose_mask_token``).
    """
    check_tokenizer(target)
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
        regenerate=regeneration_settings(config))
