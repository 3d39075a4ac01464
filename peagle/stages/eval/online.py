"""Online acceptance with our own speculative-decoding loop: HF target, the draft's own proposer.

gpt-fast's shape: one function per step of the algorithm, a target labelled q and a draft labelled p,
and an ``accept_counts`` histogram (:mod:`peagle.stages.eval.acceptance`) turned into acceptance
length in one place. Batch size 1, one prompt at a time.

State between steps: ``tokens`` (prompt + generated), the target's KV cache over all tokens but the
last one, and the target's aux states of the same positions. A step:

1. :func:`propose` -- the drafter reads ``tokens`` and the aux states and returns K draft
   distributions and the K drafts: a P-EAGLE draft in one forward (the real slot, then K−1 mask
   slots, exactly as vLLM's parallel drafting), an EAGLE-3 draft in K forwards, each fed the
   previous draft and pre-norm hidden state (vLLM's eagle3 drafting; ``peagle.model.proposer``);
2. :func:`verify` -- one target forward over ``[last token, d_1 … d_K]`` gives K+1 target
   distributions and the aux states of those positions;
3. :func:`accept_greedy` (temperature 0: d_j is kept while it equals the target's argmax) or
   :func:`accept_sampling` (temperature > 0: the standard rejection rule, keep d_j with probability
   min(1, q(d_j)/p(d_j)), else draw from norm(max(q − p, 0)) and stop; a bonus draw from q after
   K acceptances), which together preserve the target's distribution exactly;
4. :func:`commit` -- append the a accepted drafts and the target's own next token, crop the KV cache
   and the aux states to the accepted prefix.

Plain decoding (:func:`plain_generate`: one target forward per token, same cache) is the baseline
for the output check (greedy speculative output equals greedy plain output) and for the speedup.
The drafter keeps the draft's keys and values of the context between steps, as vLLM does, so a
step runs the draft over the newly accepted tokens and the K - 1 mask slots (or chain steps) only.

Shape letters: S tokens so far, P = S − 1 positions with aux states, A aux layers, H hidden, K
drafts, V target vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.model.gqa_attention import use_gqa_sdpa
from peagle.model.target.directory import load_causal_lm
from peagle.model.proposer import CachedProposer
from peagle.pipeline.progress import track
from peagle.stages.eval.acceptance import AcceptanceHistogram

Pick = Callable[[Tensor], int]
"""``pick(logits_V) -> token``: the draft token chosen from one draft distribution over the target
vocab (the sampler's: the argmax, or a draw)."""

Drafter = Callable[[Tensor, Tensor, int, Pick], tuple[Tensor, list[int]]]
"""``(tokens_S, aux_PAH, K, pick) -> (logits_KV, drafts_K)``: K draft distributions over the target
vocab (−inf where the draft cannot propose) and the K drafts ``pick`` chose from them; a sequential
drafter feeds each choice to its next forward. Draft j is the guess for token S + j − 1."""


class TargetLM(Protocol):
    """What the loop needs from a target: logits and aux states of new tokens, with a KV cache."""

    def forward(self, input_ids_L: Tensor, cache) -> tuple[Tensor, Tensor, object]: ...


class HFTarget:
    """A transformers causal LM: ``forward(ids, cache) -> (logits_LV fp32 on CPU, aux_LAH, cache)``.

    Aux states are ``hidden_states[i]`` for the draft's aux layer ids: the stream entering layer i,
    the same tensors extraction stores (docs/store.md). They stay on the model's device; logits come
    back to the CPU, where acceptance and sampling run. :meth:`load` attends with
    :mod:`peagle.model.gqa_attention` (verification's masked forwards without K/V head copies).

    ``compiled``: the forward runs under ``torch.compile`` (dynamic shapes), plain decoding and
    verification alike: on 2 CPU cores SmolLM2's plain step drops from ~45 to ~32 ms, so the target
    alone is measured at its fastest setting (benchmarks/own_loop.py). Dynamo guards on the KV
    cache's strides, and a cache holds three layouts (the prefill's transposed projections, a
    ``torch.cat``'s contiguous tensors, a crop's views of longer ones): each would be a recompile
    (~30 s here) and a run hits the recompile limit. So a compiled target makes the cache contiguous
    before each forward (a copy only after a prefill or a crop): a run compiles 4 graphs (the prefill,
    one token, several, and transformers' output-capture hook).
    """

    def __init__(self, model, aux_layer_ids: list[int], *, compiled: bool = False):
        self.model = model.eval()
        self.aux_layer_ids = list(aux_layer_ids)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        self.compiled = compiled
        self._forward = torch.compile(model, dynamic=True) if compiled else model

    @classmethod
    def load(cls, model_dir: str, aux_layer_ids: list[int], *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", compiled: bool = False) -> "HFTarget":
        return cls(use_gqa_sdpa(load_causal_lm(model_dir, dtype, device)), aux_layer_ids, compiled=compiled)

    @torch.no_grad()
    def forward(self, input_ids_L: Tensor, cache):
        if self.compiled and cache is not None:
            _make_contiguous(cache)
        out = self._forward(input_ids=input_ids_L.to(self.device)[None], past_key_values=cache, use_cache=True,
                            output_hidden_states=True)
        aux_LAH = torch.stack([out.hidden_states[i][0] for i in self.aux_layer_ids], dim=1)
        return out.logits[0].float().cpu(), aux_LAH, out.past_key_values


def _make_contiguous(cache) -> None:
    """Every layer's keys and values of a transformers ``DynamicCache`` as contiguous tensors."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and not layer.keys.is_contiguous():
            layer.keys = layer.keys.contiguous()
        if getattr(layer, "values", None) is not None and not layer.values.is_contiguous():
            layer.values = layer.values.contiguous()


def proposer_drafter(draft: PEagleDraft, target_vocab_size: int) -> Drafter:
    """The draft's proposer as a Drafter (P-EAGLE's one forward, or EAGLE-3's K, by ``config.method``),
    with the draft's KV cache of the context kept between steps as vLLM keeps it
    (:class:`peagle.model.proposer.CachedProposer`: a new prompt starts it over): draft-vocab logits
    scattered into the target vocab (on CPU)."""
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    target_of_draft = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=device)).cpu()
    proposer = CachedProposer(draft)

    def over_target_vocab(logits_XV: Tensor) -> Tensor:
        out_XV = torch.full((logits_XV.shape[0], target_vocab_size), float("-inf"))
        out_XV[:, target_of_draft] = logits_XV.float().cpu()
        return out_XV

    def parallel(tokens_S: Tensor, aux_PAH: Tensor, num_depths: int, pick: Pick) -> tuple[Tensor, list[int]]:
        proposal = proposer.propose(tokens_S.to(device), aux_PAH.to(device=device, dtype=dtype), num_depths)
        logits_KV = over_target_vocab(proposal.logits_KV)
        return logits_KV, [pick(row) for row in logits_KV]

    def sequential(tokens_S: Tensor, aux_PAH: Tensor, num_depths: int, pick: Pick) -> tuple[Tensor, list[int]]:
        rows, drafts = [], []

        def choose(draft_logits_V: Tensor) -> Tensor:
            rows.append(over_target_vocab(draft_logits_V[None])[0])
            drafts.append(pick(rows[-1]))
            return torch.tensor(drafts[-1])

        proposer.propose(tokens_S.to(device), aux_PAH.to(device=device, dtype=dtype), num_depths, choose)
        return torch.stack(rows), drafts

    return sequential if draft.config.method == "eagle3" else parallel


@dataclass
class DecodeState:
    tokens: list[int]
    cache: object
    aux_PAH: Tensor  # aux states of positions 0 .. len(tokens) - 2


@dataclass
class Generation:
    """One prompt's continuation and what it cost."""

    tokens: list[int]
    seconds: float
    num_target_forwards: int
    histogram: AcceptanceHistogram | None = None


@dataclass
class Sampler:
    """Greedy at temperature 0; else softmax(logits / temperature) with a seeded generator."""

    temperature: float = 0.0
    seed: int = 0
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits_XV: Tensor) -> Tensor:
        return torch.softmax(logits_XV.float() / self.temperature, dim=-1)

    def sample(self, probs_V: Tensor) -> int:
        return int(torch.multinomial(probs_V, 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))

    def pick(self, logits_V: Tensor) -> int:
        return int(logits_V.argmax()) if self.greedy else self.sample(self.probs(logits_V[None])[0])


def prefill(target: TargetLM, prompt_ids: list[int], sampler: Sampler) -> DecodeState:
    """Target forward over the prompt; its next token becomes the pending last token."""
    logits_LV, aux_LAH, cache = target.forward(torch.tensor(prompt_ids), None)
    return DecodeState(tokens=list(prompt_ids) + [sampler.pick(logits_LV[-1])], cache=cache, aux_PAH=aux_LAH)


def propose(drafter: Drafter, state: DecodeState, num_depths: int, sampler: "Sampler") -> tuple[Tensor, list[int]]:
    """K draft distributions (logits over the target vocab) and the K drafts the sampler picked."""
    return drafter(torch.tensor(state.tokens), state.aux_PAH, num_depths, sampler.pick)


def verify(target: TargetLM, state: DecodeState, draft_ids_K: list[int]) -> tuple[Tensor, Tensor]:
    """One target forward over ``[last token, d_1 … d_K]``: logits ``[K+1, V]`` and aux ``[K+1, A, H]``."""
    logits_LV, aux_LAH, state.cache = target.forward(torch.tensor([state.tokens[-1], *draft_ids_K]), state.cache)
    return logits_LV, aux_LAH


def accept_greedy(draft_ids_K: list[int], target_logits_LV: Tensor) -> tuple[int, int]:
    """(a, next token): drafts kept while they equal the target's argmax, then the target's own token."""
    target_ids = target_logits_LV.argmax(dim=-1).tolist()
    a = 0
    while a < len(draft_ids_K) and draft_ids_K[a] == target_ids[a]:
        a += 1
    return a, target_ids[a]


def accept_sampling(draft_ids_K: list[int], draft_probs_KV: Tensor, target_probs_LV: Tensor,
                    sampler: Sampler) -> tuple[int, int]:
    """(a, next token) by the standard rejection rule (module docstring); exact for any draft p."""
    for j, token in enumerate(draft_ids_K):
        q, p = float(target_probs_LV[j, token]), float(draft_probs_KV[j, token])
        if sampler.uniform() * p < q:  # accept with probability min(1, q/p)
            continue
        residual_V = (target_probs_LV[j] - draft_probs_KV[j]).clamp_min(0)
        total = float(residual_V.sum())
        return j, sampler.sample(residual_V / total if total > 0 else target_probs_LV[j])
    return len(draft_ids_K), sampler.sample(target_probs_LV[len(draft_ids_K)])


def commit(state: DecodeState, draft_ids_K: list[int], num_accepted: int, next_token: int, aux_LAH: Tensor) -> None:
    """Append the accepted drafts and the next token; keep cache and aux of the accepted prefix only."""
    kept = len(state.tokens) + num_accepted  # positions 0 .. kept-1 now have target states
    surplus = state.cache.get_seq_length() - kept
    if surplus > 0:
        state.cache.crop(-surplus)  # negative: remove that many (the absolute form is deprecated)
    state.aux_PAH = torch.cat([state.aux_PAH, aux_LAH[: num_accepted + 1]])
    state.tokens.extend(draft_ids_K[:num_accepted] + [next_token])


def speculative_generate(target: TargetLM, drafter: Drafter, prompt_ids: list[int], *, num_depths: int,
                         max_new_tokens: int, sampler: Sampler, stop_ids: set[int] = frozenset()) -> Generation:
    """Speculative decoding of one prompt; stops after ``max_new_tokens`` or a stop token."""
    start = time.perf_counter()
    histogram = AcceptanceHistogram(num_depths)
    state = prefill(target, prompt_ids, sampler)
    forwards = 1
    while not _done(state.tokens, len(prompt_ids), max_new_tokens, stop_ids):
        draft_logits_KV, draft_ids = propose(drafter, state, num_depths, sampler)
        if not sampler.greedy:
            draft_probs_KV = sampler.probs(draft_logits_KV)
        target_logits_LV, aux_LAH = verify(target, state, draft_ids)
        forwards += 1
        if sampler.greedy:
            a, next_token = accept_greedy(draft_ids, target_logits_LV)
        else:
            a, next_token = accept_sampling(draft_ids, draft_probs_KV, sampler.probs(target_logits_LV), sampler)
        histogram.add(a)
        commit(state, draft_ids, a, next_token, aux_LAH)
    tokens = _trim(state.tokens[len(prompt_ids):], max_new_tokens, stop_ids)
    return Generation(tokens=tokens, seconds=time.perf_counter() - start, num_target_forwards=forwards,
                      histogram=histogram)


def plain_generate(target: TargetLM, prompt_ids: list[int], *, max_new_tokens: int, sampler: Sampler,
                   stop_ids: set[int] = frozenset()) -> Generation:
    """Ordinary decoding, one target forward per token (the baseline)."""
    start = time.perf_counter()
    state = prefill(target, prompt_ids, sampler)
    forwards = 1
    while not _done(state.tokens, len(prompt_ids), max_new_tokens, stop_ids):
        logits_LV, _, state.cache = target.forward(torch.tensor(state.tokens[-1:]), state.cache)
        forwards += 1
        state.tokens.append(sampler.pick(logits_LV[-1]))
    tokens = _trim(state.tokens[len(prompt_ids):], max_new_tokens, stop_ids)
    return Generation(tokens=tokens, seconds=time.perf_counter() - start, num_target_forwards=forwards)


def _done(tokens: list[int], prompt_len: int, max_new_tokens: int, stop_ids: set[int]) -> bool:
    generated = tokens[prompt_len:]
    return len(generated) >= max_new_tokens or any(t in stop_ids for t in generated)


def _trim(generated: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Cut at the first stop token (kept, as vLLM returns it) and at ``max_new_tokens``."""
    for i, t in enumerate(generated):
        if t in stop_ids:
            generated = generated[: i + 1]
            break
    return generated[:max_new_tokens]


# --------------------------------------------------------------------------------------------------
# Many prompts


@dataclass
class PromptResult:
    prompt_len: int
    spec: Generation
    plain: Generation | None

    @property
    def matches_plain(self) -> bool | None:
        return None if self.plain is None else self.spec.tokens == self.plain.tokens


@dataclass
class OnlineResult:
    """Own-loop results over a prompt set."""

    num_depths: int
    temperature: float
    prompts: list[PromptResult]

    def histogram(self, subset: list[int] | None = None) -> AcceptanceHistogram:
        hist = AcceptanceHistogram(self.num_depths)
        for i, r in enumerate(self.prompts):
            if subset is None or i in subset:
                hist.merge(r.spec.histogram)
        return hist

    def non_repetitive(self, threshold: float = 0.5) -> list[int]:
        """Prompts whose speculative continuation has at least ``threshold`` distinct 4-grams (a tiny
        greedy target can loop, and loops are easy to draft: report acceptance without them too)."""
        return [i for i, r in enumerate(self.prompts) if distinct_ngram_ratio(r.spec.tokens) >= threshold]

    def to_dict(self) -> dict:
        spec_tokens = sum(len(r.spec.tokens) for r in self.prompts)
        spec_seconds = sum(r.spec.seconds for r in self.prompts)
        spec_forwards = sum(r.spec.num_target_forwards for r in self.prompts)
        out = {
            "num_prompts": len(self.prompts),
            "num_depths": self.num_depths,
            "temperature": self.temperature,
            **self.histogram().to_dict(),
            "generated_tokens": spec_tokens,
            "target_forwards": spec_forwards,
            "tokens_per_target_forward": spec_tokens / spec_forwards if spec_forwards else float("nan"),
            "spec_seconds": spec_seconds,
            "spec_tokens_per_second": spec_tokens / spec_seconds if spec_seconds else float("nan"),
        }
        subset = self.non_repetitive()
        sub = self.histogram(subset)
        out["non_repetitive"] = {"num_prompts": len(subset), "acceptance_length": sub.acceptance_length()
                                 if sub.num_steps else float("nan"),
                                 "per_depth_acceptance": sub.per_depth_acceptance()}
        plains = [r.plain for r in self.prompts if r.plain is not None]
        if plains:
            plain_tokens = sum(len(p.tokens) for p in plains)
            plain_seconds = sum(p.seconds for p in plains)
            out["plain_seconds"] = plain_seconds
            out["plain_tokens_per_second"] = plain_tokens / plain_seconds if plain_seconds else float("nan")
            out["speedup"] = (out["spec_tokens_per_second"] / out["plain_tokens_per_second"]
                              if plain_seconds and spec_seconds else float("nan"))
            if self.temperature <= 0:
                out["greedy_output_matches_plain"] = all(r.matches_plain for r in self.prompts)
        out["per_prompt"] = [{"prompt_len": r.prompt_len, "generated": len(r.spec.tokens),
                              "acceptance_length": r.spec.histogram.acceptance_length()
                              if r.spec.histogram.num_steps else float("nan"),
                              "distinct_4gram_ratio": distinct_ngram_ratio(r.spec.tokens),
                              "matches_plain": r.matches_plain} for r in self.prompts]
        return out


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / n-grams of a token list (1.0: no repetition; ~0: a loop)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def evaluate_online(target: TargetLM, drafter: Drafter, prompts: list[list[int]], *, num_depths: int,
                    max_new_tokens: int, temperature: float = 0.0, seed: int = 0, stop_ids: set[int] = frozenset(),
                    with_plain: bool = True, progress: bool = False) -> OnlineResult:
    """Speculative (and, with ``with_plain``, plain) decoding of every prompt; seeds fixed per prompt."""
    if prompts:  # warm-up (first-call allocations, lazy inits): kept out of both timings
        speculative_generate(target, drafter, prompts[0], num_depths=num_depths, max_new_tokens=2, sampler=Sampler())
        plain_generate(target, prompts[0], max_new_tokens=2, sampler=Sampler())
    results = []
    for i, prompt in enumerate(track(prompts, desc="online decoding", unit="prompt", enabled=progress)):
        spec = speculative_generate(target, drafter, prompt, num_depths=num_depths, max_new_tokens=max_new_tokens,
                                    sampler=Sampler(temperature, seed + i), stop_ids=stop_ids)
        plain = plain_generate(target, prompt, max_new_tokens=max_new_tokens, sampler=Sampler(temperature, seed + i),
                               stop_ids=stop_ids) if with_plain else None
        results.append(PromptResult(prompt_len=len(prompt), spec=spec, plain=plain))
    return OnlineResult(num_depths=num_depths, temperature=temperature, prompts=results)
