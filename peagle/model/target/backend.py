"""What a target backend (hf, vllm) owes its callers: per-sample aux states and top-k log-probs for
``peagle extract``, the target's own continuations for ``--regenerate`` and ``peagle prompts``.

Both backends satisfy :class:`TargetBackend` structurally (neither inherits from it); one function
opens either (:func:`peagle.model.target.backend_choice.open_backend`).

Shape legend: T tokens of one sample, A aux layers, H hidden size, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class TargetOutput:
    """The target's view of one sample, in the conventions of docs/store.md and docs/indexing.md.

    ``aux_TAH[i, a]`` is HF ``hidden_states[aux_layer_ids[a]][i]`` (the stream entering that layer
    after reading x_0..x_i); ``topk_*_TK[i]`` is the target's distribution of x_{i+1}
    (log-softmax over the full target vocab, descending by log-prob).
    """

    aux_TAH: torch.Tensor  # bfloat16 (or float32 when compute is fp32; the writer casts to bf16)
    topk_ids_TK: torch.Tensor  # int32
    topk_logprobs_TK: torch.Tensor  # float32


class Generator(Protocol):
    """What a backend offers for generation (``--regenerate``, ``peagle prompts``).

    ``generate`` returns each prompt's continuation, in order, without the stop token; the same
    prompts, settings and seed give the same continuations.
    """

    name: str

    def generate(self, prompts_token_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int) -> list[list[int]]: ...


class TargetBackend(Generator, Protocol):
    """A loaded target model that turns token-id sequences into ``TargetOutput``s, and generates.

    ``run`` is called with a fixed batch of samples (the driver decides batching so that results do
    not depend on timing); it returns one output per input, in order. Backends must not reorder.
    ``close`` frees the model (and a vLLM engine's processes).
    """

    def run(self, token_ids: list[list[int]]) -> list[TargetOutput]: ...

    def close(self) -> None: ...
