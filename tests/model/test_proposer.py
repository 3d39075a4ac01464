"""Training <-> serving parity (docs/indexing.md): the training forward over a full-chain flat COD row gives,
at every anchor and depth, the logits the vLLM-layout proposer gives on that anchor's prefix."""

from __future__ import annotations

import pytest
import torch

from peagle.model.draft import PEagleDraft
from peagle.model.mask import dense_peagle_mask
from peagle.model.proposer import build_proposer_inputs, propose
from peagle.schemas.draft_config import DraftConfig
from peagle.testing.cod_masks import cod_block_mask

MASK_ID = 250
NUM_AUX, HIDDEN = 3, 64


def random_draft(seed: int, **overrides) -> PEagleDraft:
    fields = dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  num_layers=2, target_hidden_size=HIDDEN, num_aux=NUM_AUX, target_vocab_size=256,
                  draft_vocab_size=64, mask_token_id=MASK_ID, max_position_embeddings=512,
                  aux_layer_ids=[1, 3, 5])
    fields.update(overrides)
    torch.manual_seed(seed)
    draft = PEagleDraft(DraftConfig(**fields)).eval()
    draft.set_vocab_map(torch.arange(0, 256, 4))
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return draft


def full_chain_row(samples: list[tuple[torch.Tensor, torch.Tensor]], num_depths: int):
    """Pack samples (tokens x_0..x_{n-1}, aux [n, A, H]) into one training row, docs/indexing.md, docs/cod.md layout.

    Element (anchor a, depth d) of a sample has reference position p = a + d (RoPE position, counted
    from the sample's start); depth 0 reads (x_{p+1}, aux[p]), depth >= 1 (mask, mask_hidden). Every
    anchor a in [0, n-2] appears at every depth. Anchors are row offsets; lengths are n - 1.
    """
    lengths = [tokens.numel() - 1 for tokens, _ in samples]
    offsets = [sum(lengths[:i]) for i in range(len(samples))]
    real_ids = torch.cat([tokens[1:] for tokens, _ in samples])
    aux_RAH = torch.cat([aux[:-1] for _, aux in samples])
    anchor, depth, position = [], [], []
    for d in range(num_depths):
        for (tokens, _), offset, length in zip(samples, offsets, lengths):
            anchor.append(torch.arange(length) + offset)
            depth.append(torch.full((length,), d))
            position.append(torch.arange(length) + d)
    anchor_N, depth_N, position_N = torch.cat(anchor), torch.cat(depth), torch.cat(position)
    token_ids_N = torch.cat([real_ids, torch.full((anchor_N.numel() - real_ids.numel(),), MASK_ID)])
    return token_ids_N, aux_RAH, anchor_N, depth_N, position_N, lengths, offsets


def make_sample(n: int, generator: torch.Generator):
    tokens = torch.randint(0, MASK_ID, (n,), generator=generator)
    aux = 3.0 * torch.randn(n, NUM_AUX, HIDDEN, generator=generator)
    return tokens, aux


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("overrides", [{}, {"norm_before_residual": True, "num_layers": 3, "rope_parameters": {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    {"architecture": "qwen3", "norm_before_fc": True, "fc_norm": True}])
def test_training_forward_equals_proposer_at_every_anchor_and_depth(backend, overrides):
    num_depths = 4
    draft = random_draft(seed=0, **overrides)
    generator = torch.Generator().manual_seed(1)
    samples = [make_sample(n, generator) for n in (13, 9)]  # packed: positions restart per sample
    token_ids_N, aux_RAH, anchor_N, depth_N, position_N, lengths, offsets = full_chain_row(samples, num_depths)
    lengths_D, row_len = torch.tensor(lengths), sum(lengths)
    if backend == "sdpa":
        mask = dense_peagle_mask(anchor_N, depth_N, lengths_D, row_len)
    else:
        mask = cod_block_mask(anchor_N, depth_N, lengths_D, row_len, block_size=16)
    with torch.no_grad():
        train_logits_NV = draft.compute_logits(draft(token_ids_N, aux_RAH, position_N, mask))

    num_checked = 0
    for (tokens, aux), offset, length in zip(samples, offsets, lengths):
        for a in range(length):
            proposal = propose(draft, tokens[: a + 2], aux[: a + 1], num_depths)
            chain = [int(torch.nonzero((anchor_N == offset + a) & (depth_N == d))) for d in range(num_depths)]
            torch.testing.assert_close(proposal.logits_KV, train_logits_NV[chain], atol=2e-5, rtol=1e-5)
            num_checked += 1
    assert num_checked == sum(lengths)


def test_proposer_inputs_follow_vllm_layout():
    tokens = torch.tensor([10, 11, 12, 13])  # x_0..x_3; x_3 is the token the target just sampled
    aux = torch.zeros(3, NUM_AUX, HIDDEN)  # aux[0..2]
    slot_ids, positions, causal = build_proposer_inputs(tokens, aux, num_depths=3, mask_token_id=MASK_ID)
    assert slot_ids.tolist() == [11, 12, 13, MASK_ID, MASK_ID]  # shifted tokens, then K-1 mask slots
    assert positions.tolist() == [0, 1, 2, 3, 4]  # slot i pairs x_{i+1} with aux[i] at position i
    assert torch.equal(causal, torch.ones(5, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError):
        build_proposer_inputs(tokens[:3], aux, num_depths=3, mask_token_id=MASK_ID)


def test_proposal_tokens_are_target_ids_of_the_argmax():
    draft = random_draft(seed=3)
    tokens, aux = make_sample(6, torch.Generator().manual_seed(2))
    proposal = propose(draft, tokens, aux[:5], num_depths=3)
    assert proposal.logits_KV.shape == (3, 64)
    assert torch.equal(proposal.draft_ids_K, proposal.logits_KV.argmax(-1))
    assert torch.equal(proposal.token_ids_K, proposal.draft_ids_K * 4)  # draft vocab = target ids 0, 4, 8, ...


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("overrides", [{}, {"norm_before_residual": True, "num_layers": 3},
                                       {"architecture": "qwen3", "norm_before_fc": True, "fc_norm": True}])
def test_the_cached_proposer_equals_the_uncached_one_as_a_context_grows_and_changes(method, overrides):
    """Contexts as a decoding loop sees them (growing by 1..K+1 tokens a step), then another prompt
    sharing the first one's opening tokens, the same context twice, then a shorter one: every
    proposal as without a cache."""
    from peagle.model.proposer import CachedProposer, propose_sequential

    extra = {"method": "eagle3", "mask_token_id": None} if method == "eagle3" else {}
    draft = random_draft(seed=4, **overrides, **extra)
    uncached = propose_sequential if method == "eagle3" else propose
    cached = CachedProposer(draft)
    tokens, aux = make_sample(30, torch.Generator().manual_seed(5))
    other_tokens, other_aux = make_sample(20, torch.Generator().manual_seed(6))
    other_tokens[:8], other_aux[:7] = tokens[:8], aux[:7]  # a shared prefix (a chat template's opening)
    contexts = [(tokens, aux, p) for p in (3, 4, 7, 8, 12, 17, 18, 24)] + \
               [(other_tokens, other_aux, p) for p in (9, 15, 15)] + [(tokens, aux, 5)]
    for num_depths in (1, 3):
        for sample_tokens, sample_aux, p in contexts:
            want = uncached(draft, sample_tokens[: p + 2], sample_aux[: p + 1], num_depths)
            got = cached.propose(sample_tokens[: p + 2], sample_aux[: p + 1], num_depths)
            torch.testing.assert_close(got.logits_KV, want.logits_KV, atol=2e-5, rtol=1e-5)
            assert torch.equal(got.token_ids_K, want.token_ids_K)
