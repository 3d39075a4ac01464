"""What a target backend (hf, vllm) owes the extract driver: per-sample aux states and top-k log-probs.

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


class TargetBackend(Protocol):
    """A loaded target model that turns token-id sequences into ``TargetOutput``s.

    ``run`` is called with a fixed batch of samples (the driver decides batching so that results do
    not depend on timing); it returns one output per input, in order. Backends must not reorder.
    """

    name: str

    def run(self, token_ids: list[list[int]]) -> list[TargetOutput]: ...

    def close(self) -> None: ...
