"""Sequential drafting (EAGLE-3): training-time test over a packed row equals vLLM-style drafting, chain by chain.

The reference is :func:`peagle.model.proposer.propose_sequential`, which drafts as vLLM's ``eagle3``
proposer does (a causal forward over the context, then one forward per draft fed the previous
pre-norm hidden state), here fed the row's own tokens. :func:`peagle.model.sequential.unroll` must
give, at every element (anchor a, depth d) of a row of packed samples, the logits the proposer gives
for draft d + 1 on that sample's prefix ending at a: same tokens, hidden states, positions and
keys, whatever the mask form (dense, per document, flex).
"""

from __future__ import annotations

import pytest
import torch

from peagle.model.draft import PEagleDraft
from peagle.model.mask import block_mask_from_indices, cod_block_indices, dense_mask, document_ids, document_masks, \
    peagle_mask_mod
from peagle.model.proposer import propose_sequential
from peagle.model.sequential import unroll
from peagle.schemas.draft_config import DraftConfig
from peagle.stages.train.cod import every_chain, pack_cod

NUM_AUX, HIDDEN, K = 3, 64, 4

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def eagle3_draft(seed: int, **overrides) -> PEagleDraft:
    fields = dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  num_layers=2, target_hidden_size=HIDDEN, num_aux=NUM_AUX, target_vocab_size=256,
                  draft_vocab_size=64, mask_token_id=None, method="eagle3", max_position_embeddings=512,
                  aux_layer_ids=[1, 3, 5])
    fields.update(overrides)
    torch.manual_seed(seed)
    draft = PEagleDraft(DraftConfig(**fields)).eval()
    draft.set_vocab_map(torch.arange(0, 256, 4))
    with torch.no_grad():  # norms far from 1, so that a skipped or swapped norm would show
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return draft


def packed_row(lengths: list[int], generator: torch.Generator):
    """Samples of n tokens packed into one training row (T = n - 1 positions each), every chain of each
    (``every_chain``, every position but the last supervised), in flat COD layout."""
    samples = [(torch.randint(0, 256, (n,), generator=generator), 3.0 * torch.randn(n, NUM_AUX, HIDDEN,
                                                                                     generator=generator))
               for n in lengths]
    positions = [n - 1 for n in lengths]
    starts = [sum(positions[:i]) for i in range(len(positions))]
    draws = [every_chain(T, torch.arange(T) < T - 1, K) for T in positions]
    anchor_N, depth_N, position_N = pack_cod(draws, starts)
    tokens_T = torch.cat([tokens[1:] for tokens, _ in samples])
    aux_TAH = torch.cat([aux[:-1] for _, aux in samples])
    per_depth = torch.bincount(depth_N, minlength=K)
    depth_starts = (0, *torch.cumsum(per_depth, 0).tolist())
    return samples, starts, positions, tokens_T, aux_TAH, anchor_N, depth_N, position_N, depth_starts


def step_masks(form: str, anchor_N, depth_N, positions, depth_starts):
    lengths, total = torch.tensor(positions), sum(positions)
    doc_N = document_ids(anchor_N, lengths, total)
    masks = []
    for start, stop in zip(depth_starts, depth_starts[1:]):
        rows = slice(start, stop)
        if form == "dense":
            masks.append(dense_mask(anchor_N, depth_N, doc_N, rows))
        elif form == "per_document":
            masks.append(document_masks(anchor_N, depth_N, doc_N, rows))
        else:
            masks.append(block_mask_from_indices(cod_block_indices(anchor_N, depth_N, lengths, total, block_size=8,
                                                                   rows=rows),
                                                 peagle_mask_mod(anchor_N, depth_N, doc_N, rows)))
    return masks


def run_unroll(draft, row, form: str):
    _, _, positions, tokens_T, aux_TAH, anchor_N, depth_N, position_N, depth_starts = row
    masks = step_masks(form, anchor_N, depth_N, positions, depth_starts)
    return unroll(draft, tokens_T[anchor_N + depth_N], aux_TAH, position_N, anchor_N, depth_starts, masks)


def test_an_eagle3_draft_has_no_mask_slots():
    draft = eagle3_draft(0)
    assert draft.mask_hidden is None and "mask_hidden" not in draft.state_dict()
    with pytest.raises(AssertionError, match="no mask slots"):
        draft(torch.zeros(2, dtype=torch.long), torch.zeros(2, NUM_AUX, HIDDEN), torch.arange(3),
              torch.ones(3, 3, dtype=torch.bool))


@pytest.mark.parametrize("variant", [{}, {"architecture": "qwen3", "norm_before_residual": True},
                                     {"norm_before_fc": True, "fc_norm": True}])
def test_training_time_test_equals_sequential_drafting_chain_by_chain(variant):
    draft = eagle3_draft(1, **variant)
    row = packed_row([7, 11, 5], torch.Generator().manual_seed(1))
    samples, starts, _, tokens_T, _, anchor_N, depth_N, _, _ = row
    with torch.no_grad():
        logits_NV = draft.compute_logits(run_unroll(draft, row, "per_document"))
    checked = 0
    for s, ((tokens, aux), start) in enumerate(zip(samples, starts)):
        for a in range(tokens.numel() - 1):
            chain = ((anchor_N == start + a)).nonzero().flatten()  # its elements, depth ascending
            # Draft j + 1 is fed x_{a+j+2}, the token training feeds element (a, j + 1): the data's.
            forced = iter(tokens[a + 2:].tolist() + [0] * K)
            proposal = propose_sequential(draft, tokens[: a + 2], aux[: a + 1], chain.numel(),
                                          choose=lambda logits_V: torch.tensor(next(forced)))
            torch.testing.assert_close(logits_NV[chain], proposal.logits_KV, atol=2e-5, rtol=2e-5)
            checked += int(chain.numel())
    assert checked == anchor_N.numel() and int(depth_N.max()) == K - 1


def test_every_mask_form_gives_the_same_states_and_gradients():
    row = packed_row([9, 6], torch.Generator().manual_seed(2))
    draft = eagle3_draft(2).train()
    out, grads = {}, {}
    for form in ("dense", "per_document"):
        draft.zero_grad(set_to_none=True)
        hidden = run_unroll(draft, row, form)
        (draft.compute_logits(hidden).logsumexp(-1).sum()).backward()
        out[form] = hidden.detach()
        grads[form] = {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out["dense"], out["per_document"], atol=1e-5, rtol=1e-5)
    assert grads["dense"].keys() == grads["per_document"].keys() == {
        name for name, p in draft.named_parameters() if p.requires_grad}
    for name, grad in grads["dense"].items():
        torch.testing.assert_close(grad, grads["per_document"][name], atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # flex has a CPU forward (eager), no CPU backward
        torch.testing.assert_close(run_unroll(draft, row, "flex"), out["dense"], atol=1e-5, rtol=1e-5)


def test_deeper_losses_reach_the_first_step_through_the_fed_back_states_and_the_cache():
    """A loss on depth-2 elements only moves fc (depth 0's input): its gradient flows back through the
    depth-1 hidden states and the depth-0 keys of the cache, as training-time test requires."""
    row = packed_row([10], torch.Generator().manual_seed(3))
    draft = eagle3_draft(3).train()
    hidden = run_unroll(draft, row, "dense")
    depth_N = row[6]
    hidden[depth_N == 2].square().sum().backward()
    assert draft.fc.weight.grad is not None and float(draft.fc.weight.grad.abs().sum()) > 0
