"""transformers' sdpa attention without the K/V head copies it makes under a mask on a CPU.

A speculative step's verification runs the target over K + 1 new tokens with a KV cache, so
transformers passes SDPA a causal mask (its ``is_causal`` flag is top-left aligned, wrong once keys
outnumber queries). Under a mask its sdpa path repeats every K/V head to the query heads first
(``repeat_kv``: CUDA's fused kernels need that) and only a mask-free call, such as a plain
decoding step over one token, gets ``enable_gqa``. torch's CPU kernel takes ``enable_gqa`` with a
mask as it is, so on a CPU the copies are pure cost: two per layer per verification, ~1-2 ms of a
~45 ms SmolLM2 verification on 2 cores timed alone, ~1 % of our loop's speed with a trained draft
(benchmarks/own_loop.py; the same-output check is tests/model/test_gqa_attention.py).

:func:`use_gqa_sdpa` switches a loaded model to :data:`NAME`: transformers' own sdpa function in
every case but "CPU, grouped K/V heads, a mask", where one SDPA call with ``enable_gqa`` replaces
the copies. Outputs are the same numbers: the kernel reads each K/V head for its query group
instead of a copy of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "peagle_sdpa_gqa"
"""The attention implementation's name in transformers' registries (and a model's config)."""


def sdpa_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[B, H, L, D]`` query, ``[B, H_kv, S, D]`` keys and
    values; returns ``[B, L, H, D]`` and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain_case = (attention_mask is None or groups == 1 or query.device.type != "cpu"
                  or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None)
    if plain_case:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # a mask: never is_causal (as transformers)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model: Any) -> Any:
    """Switch a transformers model that attends with sdpa to :data:`NAME` (registered here, with sdpa's
    mask function); any other implementation is left as it is. Returns the model."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return model
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model
