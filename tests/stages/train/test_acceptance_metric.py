"""The training step's acceptance length is the offline evaluator's, chain for chain (issue 13).

``summarise``'s ``acceptance_length_estimate`` averages over the complete COD chains of the batches
(``batch.chain_targets``); ``peagle.stages.eval.offline`` averages over every fully supervised chain
of the same samples. When COD draws every such chain the two must agree exactly: same chains, same
drafts, same targets, same rule for targets the draft cannot produce.

Why the samples' supervision is widened: COD draws ``int((n_valid − d) · max(r**d, r_min))`` elements
at depth d from a pool that holds one more chain when ``m[0] = 0`` (the depth-0 anchor just before
the first supervised run: docs/cod.md), so even r = r_min = 1 leaves one random chain out of chat
samples, whose first positions are template tokens. With every position but the last supervised,
r = r_min = 1 draws every chain. The tokens, aux states and top-k are the real store's; the top-1
of some positions is replaced (module-level helpers below) so that chains accept 0 … K drafts and
some targets are unusable.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig

from peagle.model.draft import PEagleDraft
from peagle.model.proposer import propose
from peagle.pipeline.store import open_store
from peagle.pipeline.store_reader import TrainingSample, iter_training_samples, training_sample
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.loader_config import CodSettings
from peagle.schemas.train_config import TrainConfig
from peagle.stages.eval.offline import chain_anchors, evaluate_offline
from peagle.stages.train.batch import collate, make_item
from peagle.testing.trainer import trainer_for_draft
from peagle.stages.train.step import summarise

K = 4
COMPLETE = CodSettings(num_depths=K, down_sample_ratio=1.0, down_sample_ratio_min=1.0)


def draft_for(store, target_dir) -> PEagleDraft:
    """A 1-layer draft over the even target ids (odd top-k ids are outside its vocab), with large
    weights: clear argmax margins, so the training layout and the offline one pick the same drafts."""
    hf = AutoConfig.from_pretrained(target_dir)
    vocab = int(hf.vocab_size)
    ids = torch.tensor([i for i in range(0, vocab, 2) if i != store.settings.mask_token_id])
    config = DraftConfig.from_target_config(hf, num_layers=1, draft_vocab_size=ids.numel(),
                                            mask_token_id=store.settings.mask_token_id,
                                            aux_layer_ids=list(store.settings.aux_layer_ids))
    torch.manual_seed(0)
    draft = PEagleDraft(config)
    draft.set_vocab_map(ids)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return draft.eval()


def with_planted_targets(draft: PEagleDraft, sample: TrainingSample, seed: int) -> TrainingSample:
    """The sample with every position but the last supervised and top-1 ids edited: along the
    positions, runs where anchor q's first 0 … K drafts are made its targets (so chains accept
    varied numbers of drafts), then at random positions an odd id (top-1 outside the draft vocab)
    or an all-odd top-k (no usable target at all: dropped by ``collate``, ``num_no_target``)."""
    rng = random.Random(seed)
    T = sample.num_positions
    ids_Tk, logprobs_Tk = sample.topk_ids_Tk.clone(), sample.topk_logprobs_Tk.clone()
    top_T = logprobs_Tk.float().argmax(dim=1)
    proposals = {}
    with torch.no_grad():
        for a in range(T - K):  # the chain anchors once every position but T − 1 is supervised
            proposals[a] = propose(draft, sample.input_ids_n[:a + 2], sample.aux_TAH[:a + 1].float(), K).token_ids_K
    q = 0
    while q < T - K:  # runs: chain q's first `length` drafts become its targets (the next one is left)
        length = rng.randint(0, K)
        for d in range(length):
            ids_Tk[q + d, top_T[q + d]] = int(proposals[q][d])
        q += length + 1
    odd = [i for i in range(1, draft.config.target_vocab_size, 2)]
    for q in range(T):
        roll = rng.random()
        if roll < 0.05:
            ids_Tk[q] = torch.tensor(rng.sample(odd, ids_Tk.shape[1]), dtype=ids_Tk.dtype)
        elif roll < 0.1:
            ids_Tk[q, top_T[q]] = rng.choice(odd)
    loss_mask_n = torch.ones(T + 1, dtype=torch.bool)  # m[p] = loss_mask[p + 2]: all but m[T − 1]
    return training_sample(sample.sample_id, sample.input_ids_n, loss_mask_n,
                           torch.cat([sample.aux_TAH, sample.aux_TAH[-1:]]),
                           torch.cat([ids_Tk[:1], ids_Tk]), torch.cat([logprobs_Tk[:1], logprobs_Tk]))


@pytest.fixture(scope="module")
def planted(tiny_store):
    store = open_store(tiny_store.root)
    draft = draft_for(store, tiny_store.target_dir)
    originals = iter_training_samples(store, max_samples=6)
    samples = [with_planted_targets(draft, s, seed=i) for i, s in enumerate(originals)]
    return draft, samples, tiny_store.mask_token_id


def test_planted_samples_keep_the_store_rows(tiny_store, planted):
    """The edits touch supervision and top-1 only: tokens, aux and the rest of the top-k are the store's."""
    _, samples, _ = planted
    originals = list(iter_training_samples(open_store(tiny_store.root), max_samples=6))
    for new, old in zip(samples, originals, strict=True):
        assert torch.equal(new.tokens_T, old.tokens_T) and torch.equal(new.aux_TAH, old.aux_TAH)
        assert torch.equal(new.topk_logprobs_Tk, old.topk_logprobs_Tk)
        assert new.supervised_T[:-1].all() and not new.supervised_T[-1]


class EvalStream:
    """The trainer's evaluation stream over given batches (what TrainLoader.batches yields)."""

    def __init__(self, batches: list):
        self.list = batches

    def batches(self, epoch: int):
        return iter(self.list)


@pytest.mark.parametrize("num_segments", [1, 3])
def test_training_acceptance_length_equals_the_offline_evaluators(planted, num_segments):
    """Complete draws: the step's metric is offline AL(K), to rounding, and its chains are offline's.

    With sequence partitions a chain's depth-0 element and its deeper ones can be charged by
    different units; the step must still join them."""
    draft, samples, mask_token_id = planted
    target_to_draft = draft.target_to_draft(torch.arange(draft.config.target_vocab_size))
    items = [make_item(s, cod=COMPLETE, seed=3, epoch=0) for s in samples]
    batches = [collate(items[i:i + 3], target_to_draft_V=target_to_draft,
                       num_segments=num_segments) for i in range(0, len(items), 3)]
    assert sum(b.num_no_target for b in batches) > 0  # unusable targets are in play ...
    assert any(bool((b.chain_target_idx_CK == b.num_supervised).any()) for b in batches)  # ... inside chains

    config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", num_depths=K,
                                    sequence_partitions=num_segments, attention="sdpa", max_steps=1)
    trainer = trainer_for_draft(config, draft)
    stats, _ = trainer.step_fn.forward_backward(batches)
    train = summarise(stats)
    evaluated_stats, evaluated_no_target = trainer.step_fn.evaluate(batches)
    evaluated = summarise(evaluated_stats)
    assert evaluated_no_target == sum(b.num_no_target for b in batches)
    trainer.eval_loader = EvalStream(batches)
    eval_line = trainer.evaluate()  # the metrics line: the same figures, and the no-target count training logs
    assert eval_line["num_no_target"] == sum(b.num_no_target for b in batches) > 0
    assert eval_line["acceptance_length_estimate"] == evaluated["acceptance_length_estimate"]
    draft.eval()

    offline = evaluate_offline(draft, iter(samples), K).histogram
    assert train["num_chains"] == offline.num_steps == sum(chain_anchors(s.supervised_T, K).numel() for s in samples)
    assert abs(train["acceptance_length_estimate"] - offline.acceptance_length()) < 1e-9
    assert abs(evaluated["acceptance_length_estimate"] - offline.acceptance_length()) < 1e-9
    # Not vacuous: chains stop at every depth, and the AL is far from both ends.
    assert all(c > 0 for c in offline.counts), offline.counts
    assert 1.5 < offline.acceptance_length() < K


def test_chains_cod_stopped_early_are_left_out(planted):
    """Default COD settings draw a subset of the chains: every chain counted is a complete, fully
    supervised one (so the metric is offline AL over a random subset of offline's chains)."""
    draft, samples, mask_token_id = planted
    target_to_draft = draft.target_to_draft(torch.arange(draft.config.target_vocab_size))
    items = [make_item(s, cod=CodSettings(num_depths=K), seed=3, epoch=0) for s in samples[:3]]
    batch = collate(items, target_to_draft_V=target_to_draft)
    full_chains = sum(chain_anchors(s.supervised_T, K).numel() for s in samples[:3])
    chains = batch.chain_target_idx_CK
    assert 0 < chains.shape[0] < full_chains
    has_target = chains < batch.num_supervised
    depth_CK = batch.depth_E[chains.clamp(max=batch.num_supervised - 1)]
    assert torch.equal(depth_CK[has_target], torch.arange(K).expand_as(chains)[has_target])
    anchors = batch.anchor_N[batch.supervised_idx_E[chains[:, 0][has_target[:, 0]]]]
    assert bool(batch.supervised_T[anchors].all())
