"""Our own speculative-decoding loop: output equals plain decoding, acceptance bookkeeping, and the
rejection rule preserving the target distribution.

The target runs in float64 where outputs are compared token for token: verifying K+1 tokens in one
forward and decoding one at a time are different matmul shapes, and in float32 a near-tie of a
random-weight model could flip an argmax between the two. In float64 they agree.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from peagle.model.draft import build_draft_from_target
from peagle.schemas.draft_config import DraftConfig
from peagle.stages.eval.online import (HFTarget, Sampler, accept_sampling, distinct_ngram_ratio, evaluate_online,
                                       plain_generate, proposer_drafter, speculative_generate)

K = 3


@pytest.fixture(scope="module")
def target(tiny_llama) -> HFTarget:
    config = AutoConfig.from_pretrained(tiny_llama)
    return HFTarget.load(str(tiny_llama), [2, 4, 5], dtype=torch.float64), config


@pytest.fixture(scope="module")
def draft(tiny_llama, target):
    _, config = target
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    draft_config = DraftConfig.from_target_config(config, num_layers=1, draft_vocab_size=512,
                                                  mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"))
    torch.manual_seed(0)
    return build_draft_from_target(tiny_llama, draft_config, torch.arange(0, 1024, 2)).double().eval()


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = ["Explain what a context manager is.", "Parse a CSV line.", "What does json.dumps return?"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def oracle_drafter(hf: HFTarget):
    """A drafter whose logits are forced to the target's own greedy continuation (a perfect draft)."""
    def drafter(tokens_S, aux_PAH, num_depths, pick):
        seq, logits_KV = tokens_S.tolist(), torch.full((num_depths, hf.vocab_size), float("-inf"))
        for j in range(num_depths):
            logits, _, _ = hf.forward(torch.tensor(seq), None)
            seq.append(int(logits[-1].argmax()))
            logits_KV[j, seq[-1]] = 0.0
        return logits_KV, [pick(row) for row in logits_KV]
    return drafter


def test_greedy_speculative_output_equals_plain_decoding(target, draft, prompts):
    hf, _ = target
    result = evaluate_online(hf, proposer_drafter(draft, hf.vocab_size), prompts[:2], num_depths=K,
                             max_new_tokens=16)
    for r in result.prompts:
        assert r.spec.tokens == r.plain.tokens and len(r.spec.tokens) == 16
        hist = r.spec.histogram
        assert hist.num_steps == r.spec.num_target_forwards - 1  # prefill, then one verify per step
        produced = 1 + sum((a + 1) * c for a, c in enumerate(hist.counts))  # prefill token + a + 1 per step
        assert 0 <= produced - len(r.spec.tokens) <= K  # only the last step may overshoot
    summary = result.to_dict()
    assert summary["greedy_output_matches_plain"] is True
    assert 1.0 <= summary["acceptance_length"] <= K + 1
    assert summary["num_steps"] == sum(r.spec.num_target_forwards - 1 for r in result.prompts)


def test_a_perfect_draft_is_always_fully_accepted(target, prompts):
    hf, _ = target
    result = evaluate_online(hf, oracle_drafter(hf), prompts[2:], num_depths=K, max_new_tokens=17)
    summary = result.to_dict()
    assert summary["greedy_output_matches_plain"] is True
    hist = result.histogram()
    assert hist.counts[:K] == [0] * K and hist.counts[K] == hist.num_steps > 0
    assert hist.acceptance_lengths() == pytest.approx([2.0, 3.0, 4.0])
    assert summary["tokens_per_target_forward"] > 3.0  # 17 tokens from prefill + 4 verify forwards


def test_generation_stops_at_a_stop_token_like_plain_decoding(target, draft, prompts):
    hf, _ = target
    plain = plain_generate(hf, prompts[0], max_new_tokens=12, sampler=Sampler())
    stop = plain.tokens[6]
    cut = plain.tokens.index(stop) + 1
    for gen in (plain_generate(hf, prompts[0], max_new_tokens=12, sampler=Sampler(), stop_ids={stop}),
                speculative_generate(hf, oracle_drafter(hf), prompts[0], num_depths=K, max_new_tokens=12,
                                     sampler=Sampler(), stop_ids={stop})):
        assert gen.tokens == plain.tokens[:cut]


def test_sampling_loop_is_seeded_and_runs_to_length(target, draft, prompts):
    hf, _ = target
    drafter = proposer_drafter(draft, hf.vocab_size)
    runs = [speculative_generate(hf, drafter, prompts[1], num_depths=K, max_new_tokens=12,
                                 sampler=Sampler(temperature=1.0, seed=3)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 12


@pytest.mark.parametrize("same", [False, True])
def test_rejection_rule_preserves_the_target_distribution(same):
    """First emitted token of a step ~ q whatever the draft distribution p (and p = q never rejects)."""
    g = torch.Generator().manual_seed(0)
    vocab, trials = 6, 20_000
    q_LV = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, dim=-1)
    p_KV = q_LV[:1].clone() if same else torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, dim=-1)
    sampler = Sampler(temperature=1.0, seed=1)
    counts = torch.zeros(vocab)
    rejected = 0
    for _ in range(trials):
        draft_token = sampler.sample(p_KV[0])
        a, next_token = accept_sampling([draft_token], p_KV, q_LV, sampler)
        counts[draft_token if a == 1 else next_token] += 1
        rejected += a == 0
    total_variation = 0.5 * float((counts / trials - q_LV[0]).abs().sum())
    assert total_variation < 0.02
    if same:
        assert rejected == 0


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio(list(range(10))) == 1.0
    assert distinct_ngram_ratio([7] * 20) == pytest.approx(1 / 17)
    assert distinct_ngram_ratio([1, 2]) == 1.0



def test_a_compiled_target_decodes_the_same_tokens_without_recompiling_per_step(tmp_path, prompts):
    """``HFTarget(compiled=True)``: the same greedy tokens as eager, plain and speculative (float32, a
    draft whose guesses are always rejected: the cache is cropped every step), and the graphs stay few
    (a 2-layer target: the compile is the test's cost)."""
    import torch._dynamo

    from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target

    path = str(build_tiny_target(tmp_path / "two-layers", TinyTargetSpec(num_layers=2)))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    outputs = {}
    for compiled in (False, True):
        hf = HFTarget.load(path, [0, 1, 2], dtype=torch.float32, compiled=compiled)
        outputs[compiled] = [(plain_generate(hf, p, max_new_tokens=10, sampler=Sampler()).tokens,
                              speculative_generate(hf, lambda tokens_S, aux, k, pick: (None, [3] * k), p,
                                                   num_depths=K, max_new_tokens=10, sampler=Sampler()).tokens)
                             for p in prompts[:2]]
    assert outputs[True] == outputs[False]
    # prefill, one token, K + 1 tokens and transformers' output-capture hook; a cache left as cropped or
    # as the prefill laid it out makes a graph per layout (6 here, and more as a run goes on)
    assert 0 < torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4
