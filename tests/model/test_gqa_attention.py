"""peagle.model.gqa_attention: the same logits as transformers' sdpa, without its K/V head copies
under a mask (a verification's forward over several tokens with a KV cache)."""

from __future__ import annotations

import pytest
import torch

from peagle.model.gqa_attention import NAME, use_gqa_sdpa
from peagle.model.target.directory import load_causal_lm


def _prefill_then_verify(model, prompt: list[int], new: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill (no mask: causal) and of a later forward over several tokens (a mask)."""
    with torch.no_grad():
        first = model(input_ids=torch.tensor([prompt]), use_cache=True)
        second = model(input_ids=torch.tensor([new]), past_key_values=first.past_key_values, use_cache=True)
    return first.logits, second.logits


def _count_repeat_kv(monkeypatch) -> list[int]:
    import transformers.integrations.sdpa_attention as sdpa

    calls, original = [], sdpa.repeat_kv

    def counted(hidden, n_rep):
        calls.append(n_rep)
        return original(hidden, n_rep)

    monkeypatch.setattr(sdpa, "repeat_kv", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
def test_same_logits_as_sdpa_and_no_head_copies(family, dtype, request, monkeypatch):
    path = request.getfixturevalue(family)
    stock = load_causal_lm(path, dtype, "cpu")
    switched = use_gqa_sdpa(load_causal_lm(path, dtype, "cpu"))
    assert stock.config.num_key_value_heads < stock.config.num_attention_heads  # grouped heads: the case
    assert stock.config._attn_implementation == "sdpa" and switched.config._attn_implementation == NAME
    prompt, new = list(range(5, 40)), [7, 8, 9, 10, 11]

    copies = _count_repeat_kv(monkeypatch)
    expected = _prefill_then_verify(stock, prompt, new)
    assert len(copies) == 2 * stock.config.num_hidden_layers  # stock sdpa: K and V copied per layer, masked forward
    copies.clear()
    got = _prefill_then_verify(switched, prompt, new)
    assert copies == []
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_other_implementations_are_left_alone(tiny_llama):
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager")
    assert use_gqa_sdpa(eager).config._attn_implementation == "eager"
