"""The inference-time proposers in plain torch: P-EAGLE's one draft forward yields K draft tokens
(:func:`propose`); EAGLE-3's K forwards yield one each (:func:`propose_sequential`).

It builds the draft's input the way vLLM's parallel-drafting runtime does, so that the parity test
(tests/model/test_proposer.py) proves the training layout (docs/indexing.md) equals serving. What vLLM
does, as read in its source (vllm-project/vllm):

* ``vllm/v1/spec_decode/llm_base_proposer.py`` (``set_inputs_first_pass``) with the triton kernel
  ``copy_and_expand_eagle_inputs_kernel`` in ``vllm/v1/spec_decode/utils.py``; the same layout in
  the v2 model runner ``vllm/v1/worker/gpu/spec_decode/eagle/peagle.py``
  (``_prepare_peagle_prefill_inputs_kernel``):

  - EAGLE shifts token ids by one and keeps positions and hidden states: draft slot j of a request
    holds token ``x_{s+j+1}``, the target's (fc-combined) aux state of position ``s+j`` and RoPE
    position ``s+j`` (positions count from 0 within the request). The last real slot pairs the
    token just sampled by the target (the "bonus" token x_{p+1}) with aux[p].
  - With ``parallel_drafting`` it appends K-1 slots right after the last real slot: token id
    ``pard_token`` (= the speculators config's ``mask_token_id``, mapped in
    ``vllm/transformers_utils/configs/speculators/algos.py``), positions ``p+1 .. p+K-1``, hidden
    state ``parallel_drafting_hidden_state_tensor``, which ``load_model`` sets to
    ``model.combine_hidden_states(model.mask_hidden.view(-1))`` = ``fc(mask_hidden)``.
  - One forward with ordinary causal attention over the request (earlier real slots come from the
    draft's KV cache, which holds the depth-0 entries of earlier steps); the K sampled slots are the
    last real slot and the K-1 mask slots, in order: slot p+d gives the depth-d draft token.
  - Rejected tokens of the previous step get padding slot ids (no KV write) and mask slots' KV is
    overwritten by the next step's real tokens, so a query never sees a stale mask slot.

* ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``, also registered for
  ``PeagleLlamaForCausalLM``): layer 0 normalises embeds with ``input_layernorm`` and the hidden
  with ``hidden_norm``, concatenates ``[embeds, hidden]`` (2H q/k/v), residual from the hidden
  (normed first iff ``norm_before_residual``); final ``norm``; ``lm_head`` over the draft vocab,
  target id = draft id + ``d2t[draft id]``.

A depth-0 element at reference position p in training therefore matches the last real slot of
the prefix ending at p, and depth d matches mask slot p+d: same token, hidden, position, keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from peagle.model.draft import PEagleDraft
from peagle.model.sequential import combined_aux, decode_step


@dataclass(frozen=True)
class Proposal:
    """K drafts for one context: ``logits_KV`` over the draft vocab, ``draft_ids_K`` (the drafts: the
    argmax, or what a sequential proposer's ``choose`` drew) and ``token_ids_K`` (the same as
    target-vocab ids)."""

    logits_KV: Tensor
    draft_ids_K: Tensor
    token_ids_K: Tensor


def build_proposer_inputs(token_ids: Tensor, aux_PAH: Tensor, num_depths: int,
                          mask_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Token ids ``[P+K-1]``, positions and causal mask of one parallel-drafting step.

    ``token_ids`` are ``x_0 .. x_{p+1}`` (p+2 ids; the last is the token the target just sampled) and
    ``aux_PAH`` the target's aux states of positions ``0 .. p`` (P = p+1 rows). Real slot i reads
    ``(x_{i+1}, aux[i])`` at position i; mask slots follow at positions ``p+1 .. p+K-1``.
    """
    num_real = aux_PAH.shape[0]
    if token_ids.shape[0] != num_real + 1:
        raise ValueError(f"need {num_real + 1} token ids for {num_real} aux states, got {token_ids.shape[0]}")
    device = token_ids.device
    mask_ids = torch.full((num_depths - 1,), mask_token_id, dtype=token_ids.dtype, device=device)
    slot_ids_N = torch.cat([token_ids[1:], mask_ids])
    positions_N = torch.arange(slot_ids_N.shape[0], device=device)
    causal_NN = torch.ones(slot_ids_N.shape[0], slot_ids_N.shape[0], dtype=torch.bool, device=device).tril()
    return slot_ids_N, positions_N, causal_NN


@torch.no_grad()
def propose(draft: PEagleDraft, token_ids: Tensor, aux_PAH: Tensor, num_depths: int) -> Proposal:
    """Run one parallel-drafting step over the whole context (prefill-style, no KV cache).

    A KV cache changes nothing here: depth-0 keys depend only on earlier depth-0 slots, so the
    cached keys vLLM reuses equal the ones this single forward recomputes.
    """
    slot_ids_N, positions_N, causal_NN = build_proposer_inputs(
        token_ids, aux_PAH, num_depths, draft.config.mask_token_id)
    hidden_NH = draft(slot_ids_N, aux_PAH, positions_N, causal_NN)
    last_real = aux_PAH.shape[0] - 1
    logits_KV = draft.compute_logits(hidden_NH[last_real:last_real + num_depths])
    draft_ids_K = logits_KV.argmax(dim=-1)
    return Proposal(logits_KV, draft_ids_K, draft.draft_to_target(draft_ids_K))


@torch.no_grad()
def propose_sequential(draft: PEagleDraft, token_ids: Tensor, aux_PAH: Tensor, num_depths: int,
                       choose: Callable[[Tensor], Tensor] | None = None) -> Proposal:
    """EAGLE-3 sequential drafting of K tokens, as vLLM's ``eagle3`` proposer (peagle.model.sequential).

    The first forward runs over the context slots (the same inputs as :func:`build_proposer_inputs`'
    real slots, causal) and gives draft 1 from the last slot; forward j runs one slot at position
    ``p + j`` with draft j's target id as its token and the previous forward's pre-norm hidden,
    seeing every slot before it. ``choose(logits_V)`` (draft-vocab logits of one draft) returns the
    target id fed to the next forward: default the argmax (greedy drafting, vLLM's default); a
    sampler passes its own draw. The context is recomputed each call (no draft KV cache kept
    between calls): keys of context slots depend on context slots only, so vLLM's cached ones equal
    these.
    """
    num_real = aux_PAH.shape[0]
    if token_ids.shape[0] != num_real + 1:
        raise ValueError(f"need {num_real + 1} token ids for {num_real} aux states, got {token_ids.shape[0]}")
    if choose is None:
        def choose(logits_V: Tensor) -> Tensor:
            return draft.draft_to_target(logits_V.argmax(dim=-1, keepdim=True))
    device = token_ids.device
    causal_PP = torch.ones(num_real, num_real, dtype=torch.bool, device=device).tril()
    normed_XH, prenorm_XH, past = decode_step(draft, draft.embed_tokens(token_ids[1:]), combined_aux(draft, aux_PAH),
                                              torch.arange(num_real, device=device), causal_PP, None)
    logits = [draft.compute_logits(normed_XH[-1:])]
    chosen = [choose(logits[-1][0]).reshape(1).to(device=device, dtype=token_ids.dtype)]
    for j in range(1, num_depths):
        sees_all = torch.ones(1, num_real + j, dtype=torch.bool, device=device)
        normed_XH, prenorm_XH, past = decode_step(draft, draft.embed_tokens(chosen[-1]), prenorm_XH[-1:],
                                                  torch.tensor([num_real - 1 + j], device=device), sees_all, past)
        logits.append(draft.compute_logits(normed_XH))
        chosen.append(choose(logits[-1][0]).reshape(1).to(device=device, dtype=token_ids.dtype))
    token_ids_K = torch.cat(chosen)
    return Proposal(torch.cat(logits), draft.target_to_draft(token_ids_K), token_ids_K)


class CachedProposer:
    """:func:`propose` / :func:`propose_sequential` with the draft's keys and values of the context
    slots kept between calls, as vLLM's proposer keeps them: a call runs the draft over the slots it
    has not seen (the tokens accepted since the last call) and the K − 1 mask slots (P-EAGLE) or
    the K − 1 chain steps (EAGLE-3), not over the whole context again.

    What a cached row holds depends only on the context before it (real slot i reads ``x_{i+1}``
    and ``aux[i]``, causal), so the cache is valid for any later call whose context starts with the
    same tokens (aux rows of committed positions never change): a call checks that prefix and starts
    over when it differs (a new prompt). Only real slots are kept; mask slots and chain steps are
    recomputed each call, as vLLM overwrites them. The proposals equal the uncached functions'
    (tests/model/test_proposer.py).
    """

    def __init__(self, draft: PEagleDraft):
        self.draft = draft
        self.past: list | None = None
        self.slot_tokens: Tensor | None = None  # the cached slots' tokens (x_1 .. x_P)

    def _new_rows(self, token_ids: Tensor, num_real: int) -> int:
        """How many leading real slots the cache still holds for this context (0: start over). The
        last real slot is always recomputed: its output gives the first draft."""
        cached = 0 if self.slot_tokens is None else self.slot_tokens.shape[0]
        if cached > num_real or cached and not torch.equal(self.slot_tokens, token_ids[1:cached + 1]):
            self.past, self.slot_tokens, cached = None, None, 0
        if cached == num_real:  # the same context again: only its last slot is run again
            cached -= 1
            self._keep_real(self.past, cached)
        return cached

    def _keep_real(self, cache: list, num_real: int) -> None:
        self.past = [(k[:, :num_real], v[:, :num_real]) for k, v in cache]

    @torch.no_grad()
    def propose(self, token_ids: Tensor, aux_PAH: Tensor, num_depths: int,
                choose: Callable[[Tensor], Tensor] | None = None) -> Proposal:
        """K drafts for the context ``token_ids`` (``x_0 .. x_{p+1}``) and its aux rows (``0 .. p``):
        P-EAGLE's parallel drafting or, for an EAGLE-3 draft, sequential drafting with ``choose``."""
        draft = self.draft
        num_real = aux_PAH.shape[0]
        if token_ids.shape[0] != num_real + 1:
            raise ValueError(f"need {num_real + 1} token ids for {num_real} aux states, got {token_ids.shape[0]}")
        cached = self._new_rows(token_ids, num_real)
        device = token_ids.device
        embeds_XH = draft.embed_tokens(token_ids[cached + 1:])
        hidden_XH = combined_aux(draft, aux_PAH[cached:])
        parallel = draft.config.method != "eagle3"
        num_mask = num_depths - 1 if parallel else 0
        if num_mask:
            mask_ids = token_ids.new_full((num_mask,), draft.config.mask_token_id)
            mask_hidden_1H = draft.combine_hidden_states(draft.mask_hidden.reshape(1, -1).to(hidden_XH.dtype))
            embeds_XH = torch.cat([embeds_XH, draft.embed_tokens(mask_ids)])
            hidden_XH = torch.cat([hidden_XH, mask_hidden_1H.expand(num_mask, -1)])
        rows = num_real - cached + num_mask
        sees_XP = torch.ones(rows, cached, dtype=torch.bool, device=device)
        causal_XX = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
        normed_XH, prenorm_XH, cache = decode_step(draft, embeds_XH, hidden_XH,
                                                   torch.arange(cached, num_real + num_mask, device=device),
                                                   torch.cat([sees_XP, causal_XX], dim=1), self.past)
        self._keep_real(cache, num_real)
        self.slot_tokens = token_ids[1:].clone()
        last_real = num_real - cached - 1
        if parallel:
            logits_KV = draft.compute_logits(normed_XH[last_real:last_real + num_depths])
            draft_ids_K = logits_KV.argmax(dim=-1)
            return Proposal(logits_KV, draft_ids_K, draft.draft_to_target(draft_ids_K))
        return self._chain(normed_XH[last_real:last_real + 1], prenorm_XH[last_real:last_real + 1], cache,
                           num_real, num_depths, choose, token_ids.dtype)

    def _chain(self, normed_1H: Tensor, prenorm_1H: Tensor, cache: list, num_real: int, num_depths: int,
               choose: Callable[[Tensor], Tensor] | None, dtype: torch.dtype) -> Proposal:
        """EAGLE-3's K − 1 further forwards over the context's cache (as :func:`propose_sequential`)."""
        draft = self.draft
        device = normed_1H.device
        if choose is None:
            def choose(logits_V: Tensor) -> Tensor:
                return draft.draft_to_target(logits_V.argmax(dim=-1, keepdim=True))
        logits = [draft.compute_logits(normed_1H)]
        chosen = [choose(logits[-1][0]).reshape(1).to(device=device, dtype=dtype)]
        past = cache
        for j in range(1, num_depths):
            sees_all = torch.ones(1, num_real + j, dtype=torch.bool, device=device)
            normed_1H, prenorm_1H, past = decode_step(draft, draft.embed_tokens(chosen[-1]), prenorm_1H,
                                                      torch.tensor([num_real - 1 + j], device=device), sees_all, past)
            logits.append(draft.compute_logits(normed_1H))
            chosen.append(choose(logits[-1][0]).reshape(1).to(device=device, dtype=dtype))
        token_ids_K = torch.cat(chosen)
        return Proposal(torch.cat(logits), draft.target_to_draft(token_ids_K), token_ids_K)
