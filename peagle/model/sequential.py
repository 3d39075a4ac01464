"""Sequential drafting: one draft forward per proposed token, each reading the previous one's hidden state.

This is how an EAGLE-3 draft proposes (vLLM's ``eagle3`` method without parallel drafting) and how
it trains with *training-time test* (docs/methods.md). What vLLM 0.32 does, read in its source
(``vllm/v1/spec_decode/llm_base_proposer.py`` ``propose``, ``model_executor/models/llama_eagle3.py``):

* the first forward runs over the context slots: slot i reads token ``x_{i+1}`` and
  ``combine_hidden_states(aux_i)`` (``fc`` after the optional norms) at RoPE position i, causal;
  the last slot's logits give draft 1;
* forward j (j = 1 .. K-1) runs one slot at position ``p + j``: its token is draft j (a target id,
  embedded over the whole target vocab), its hidden state is the previous forward's output
  *before* the final norm (``norm_output`` false, the default); it attends to every earlier slot
  of the request through the draft's KV cache: the context slots and the chain's own slots.

Training-time test unrolls the same thing over every anchor at once (:func:`unroll`): step j
computes the depth-j elements of a flat COD row (docs/cod.md), whose inputs are the token at their
reference position and their parent's (depth j-1, same anchor) pre-norm output, and which see the
depth-0 elements up to their anchor and their own chain: the P-EAGLE attention rule
(:mod:`peagle.model.mask`), restricted to the queries of one depth (``rows``). Earlier steps'
keys and values are kept per layer (:data:`~peagle.model.decoder_layers.KV`), so a step costs its own rows.
Gradients flow through the cache and the fed-back hidden states, as in speculators' ``Eagle3DraftModel``.

Shape letters: M elements of a unit (depth groups in order), R its depth-0 rows, X rows of one
step, A aux layers, T target hidden, H hidden, K depths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from peagle.model.decoder_layers import KV, AttnMask
from peagle.model.draft import PEagleDraft
from peagle.model.flex import FlexFn


def decode_step(draft: PEagleDraft, embeds_XH: Tensor, hidden_XH: Tensor, position_ids_X: Tensor,
                attn_mask: AttnMask, past: list[KV] | None, flex: FlexFn | None = None
                ) -> tuple[Tensor, Tensor, list[KV]]:
    """One draft forward of X new rows over the cached keys/values of earlier ones.

    ``hidden_XH`` is layer 0's hidden input (``combine_hidden_states`` of aux rows, or a previous
    step's pre-norm output); ``attn_mask`` is the X queries over every row so far, cached ones first
    (``[X, P + X]``). Returns the final-normed hidden (for ``compute_logits``), the pre-norm hidden
    (fed to the next step) and every layer's keys/values including these rows.
    """
    cos_XD, sin_XD = draft.rope(position_ids_X)
    past = past if past is not None else [None] * len(draft.layers)
    h, kv = draft._run(draft.layers[0].step, embeds_XH, hidden_XH, cos_XD, sin_XD, attn_mask, past[0], flex)
    cache = [kv]
    for layer, layer_past in zip(draft.layers[1:], past[1:]):
        h, kv = draft._run(layer.step, h, cos_XD, sin_XD, attn_mask, layer_past, flex)
        cache.append(kv)
    return draft.norm(h), h, cache


def combined_aux(draft: PEagleDraft, aux_RAH: Tensor) -> Tensor:
    """``combine_hidden_states`` of ``[R, A, T]`` (or ``[R, A·T]``) aux rows, in fc's dtype off autocast."""
    aux_RF = aux_RAH.reshape(-1, draft.fc.in_features)
    if not torch.is_autocast_enabled(aux_RF.device.type):  # autocast casts inside fc itself
        aux_RF = aux_RF.to(draft.fc.weight.dtype)
    return draft.combine_hidden_states(aux_RF)


def unroll(draft: PEagleDraft, token_ids_M: Tensor, aux_RAH: Tensor, position_ids_M: Tensor, anchor_M: Tensor,
           depth_starts: tuple[int, ...], masks: list[AttnMask], flex: FlexFn | None = None) -> Tensor:
    """Training-time test over one unit: final-normed hidden ``[M, H]`` of its M elements, in their order.

    The unit's elements are in flat COD layout: depth groups in order (``depth_starts[j]`` ..
    ``depth_starts[j+1]`` is depth j, host ints), anchors ascending inside a group, and every
    element of depth j >= 1 has its parent (same anchor, depth j-1) in the unit. ``token_ids_M`` is
    each element's input token, ``aux_RAH`` the depth-0 rows' aux states, ``masks[j]`` step j's
    attention (``rows`` = depth j's slice: :func:`peagle.model.mask.peagle_mask_mod`). Step j
    computes depth j only; its hidden input is the parent's pre-norm output, found by a
    ``searchsorted`` of its anchor in the parents' group (on the device: no host read).
    """
    embeds_MH = draft.embed_tokens(token_ids_M)  # one lookup: one dense gradient of the table, not K
    hidden_XH = combined_aux(draft, aux_RAH)
    past: list[KV] | None = None
    normed, prenorm_XH = [], None
    for j, mask in enumerate(masks):
        start, stop = depth_starts[j], depth_starts[j + 1]
        if stop == start:  # chains are prefix-closed: no deeper element either
            break
        if j > 0:
            parents = anchor_M[depth_starts[j - 1]:start]
            hidden_XH = prenorm_XH[torch.searchsorted(parents, anchor_M[start:stop])]
        out_XH, prenorm_XH, past = decode_step(draft, embeds_MH[start:stop], hidden_XH,
                                               position_ids_M[start:stop], mask, past, flex)
        normed.append(out_XH)
    return torch.cat(normed)
