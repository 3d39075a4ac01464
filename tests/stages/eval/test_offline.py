"""Offline teacher-forced chains: indexing against the serving-time proposer, full-acceptance and
store-reading checks."""

from __future__ import annotations

import pytest
import torch

from peagle.model.draft import PEagleDraft
from peagle.model.proposer import propose
from peagle.pipeline.split import is_heldout
from peagle.schemas.draft_config import DraftConfig
from peagle.pipeline.store_reader import TrainingSample, iter_training_samples, training_sample
from peagle.stages.eval.offline import chain_anchors, chain_correct, evaluate_offline

VOCAB, DRAFT_VOCAB, MASK, K = 100, 60, 99, 3


def small_draft(seed: int = 0) -> PEagleDraft:
    config = DraftConfig(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         num_layers=2, target_hidden_size=32, num_aux=3, target_vocab_size=VOCAB,
                         draft_vocab_size=DRAFT_VOCAB, mask_token_id=MASK, max_position_embeddings=512,
                         aux_layer_ids=[1, 2, 3])
    torch.manual_seed(seed)
    draft = PEagleDraft(config)
    draft.set_vocab_map(torch.arange(DRAFT_VOCAB) * 3 // 2)  # a strict subset: d2t offsets are exercised
    with torch.no_grad():  # large weights: clear argmax margins, so paths with other rounding agree
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return draft.double().eval()


def random_sample(n: int, seed: int, loss_mask: list[int] | None = None) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    return training_sample(
        f"s{seed}", torch.randint(0, MASK, (n,), generator=g),
        torch.tensor(loss_mask, dtype=torch.bool) if loss_mask is not None else torch.ones(n, dtype=torch.bool),
        torch.randn(n, 3, 32, generator=g).to(torch.bfloat16),
        torch.randint(0, VOCAB, (n, 4), generator=g, dtype=torch.int32),
        -torch.rand(n, 4, generator=g).sort(dim=1).values,
    )


def proposer_predictions(draft: PEagleDraft, sample: TrainingSample, p: int) -> list[int]:
    """What vLLM-style parallel drafting proposes after x_0..x_{p+1} (aux of positions 0..p)."""
    return propose(draft, sample.input_ids_n[: p + 2], sample.aux_TAH[: p + 1].double(), K).token_ids_K.tolist()


def target_argmax(sample: TrainingSample) -> torch.Tensor:
    """Target argmax for x_{q+2}, indexed by q (top-1 of topk[q+1])."""
    best = sample.topk_logprobs_Tk.argmax(dim=1)
    return sample.topk_ids_Tk.long().gather(1, best[:, None]).flatten()


def test_chain_anchors_need_a_fully_supervised_chain():
    supervised = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    assert chain_anchors(supervised, 3).tolist() == [0, 4, 5]
    assert chain_anchors(supervised, 1).tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert chain_anchors(supervised[:2], 3).numel() == 0


def test_chains_equal_the_serving_proposer_at_every_anchor():
    """Each chain's K drafts are those the parallel-drafting proposer makes on the same prefix."""
    draft = small_draft()
    sample = random_sample(30, seed=1, loss_mask=[0] * 4 + [1] * 26)
    # Make about half the drafts correct: target at even q = the proposer's depth-0 draft of anchor q.
    for q in range(0, sample.num_positions - 1, 2):  # topk_*_Tk[q] is the target's distribution of x_{q+2}
        sample.topk_ids_Tk[q, sample.topk_logprobs_Tk[q].argmax()] = proposer_predictions(draft, sample, q)[0]
    correct_KC = chain_correct(draft, sample, K)
    anchors = chain_anchors(sample.supervised_T, K).tolist()
    target = target_argmax(sample)
    expected = torch.tensor([[proposer_predictions(draft, sample, p)[d] == int(target[p + d]) for p in anchors]
                             for d in range(K)])
    assert correct_KC.shape == (K, len(anchors))
    assert torch.equal(correct_KC, expected)
    assert 0 < int(correct_KC.sum()) < correct_KC.numel()


def test_chunking_does_not_change_results():
    draft = small_draft()
    sample = random_sample(40, seed=2)
    whole = chain_correct(draft, sample, K, max_elements=10_000)
    assert torch.equal(chain_correct(draft, sample, K, max_elements=16), whole)


def test_a_chain_matching_the_target_is_fully_accepted():
    """One fully supervised chain whose targets are the draft's own proposals: AL(k) = k + 1."""
    draft = small_draft()
    n, p = 20, 7
    mask = [0] * n
    for q in range(p, p + K):
        mask[q + 2] = 1  # m[q] = loss_mask[q + 2]
    sample = random_sample(n, seed=3, loss_mask=mask)
    for d, token in enumerate(proposer_predictions(draft, sample, p)):
        sample.topk_ids_Tk[p + d, sample.topk_logprobs_Tk[p + d].argmax()] = token
    result = evaluate_offline(draft, iter([sample]), K)
    assert result.histogram.counts == [0, 0, 0, 1]
    assert result.histogram.acceptance_lengths() == pytest.approx([2.0, 3.0, 4.0])
    assert result.to_dict()["top1_agreement_at_depth"] == [1.0, 1.0, 1.0]


def test_eagle3_chains_accept_what_sequential_drafting_accepts():
    """An EAGLE-3 draft's chains, fed the target's greedy tokens, accept at every anchor exactly the
    prefix that vLLM-style sequential drafting (fed its own drafts) gets accepted, whatever the
    chunking; planted chains are accepted whole."""
    import dataclasses

    from peagle.model.proposer import propose_sequential

    peagle_draft = small_draft(4)
    draft = PEagleDraft(dataclasses.replace(peagle_draft.config, method="eagle3", mask_token_id=None))
    draft.load_state_dict({k: v for k, v in peagle_draft.state_dict().items() if k != "mask_hidden"})
    draft = draft.double().eval()
    sample = random_sample(36, seed=5, loss_mask=[0] * 3 + [1] * 33)

    def drafts(p: int) -> list[int]:
        return propose_sequential(draft, sample.input_ids_n[: p + 2], sample.aux_TAH[: p + 1].double(),
                                  K).token_ids_K.tolist()

    for p in range(1, sample.num_positions - K, 2 * K):  # plant whole chains: the target agrees with them
        for d, token in enumerate(drafts(p)):
            sample.topk_ids_Tk[p + d, sample.topk_logprobs_Tk[p + d].argmax()] = token
    target = target_argmax(sample)
    anchors = chain_anchors(sample.supervised_T, K).tolist()
    served = []
    for p in anchors:
        accepted = 0
        for d, token in enumerate(drafts(p)):
            if token != int(target[p + d]):
                break
            accepted += 1
        served.append(accepted)
    for max_elements in (10_000, 20):
        correct_KC = chain_correct(draft, sample, K, max_elements=max_elements)
        assert correct_KC.long().cumprod(dim=0).sum(dim=0).tolist() == served
    assert served.count(K) >= 4 and min(served) == 0


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_llama):
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.testing.chat_data import write_chat_jsonl

    root = tmp_path_factory.mktemp("offline")
    data = write_chat_jsonl(root / "chat.jsonl", 12, seed=5)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), backend="hf",
                              topk=4, samples_per_shard=5, device="cpu", max_seq_len=256),
                echo=lambda _: None, progress=False)
    return root / "store"


def test_store_samples_and_evaluation(tiny_store, tiny_llama):
    from transformers import AutoConfig

    from peagle.pipeline.store import open_store

    store = open_store(tiny_store)
    samples = list(iter_training_samples(store))
    assert len(samples) == store.num_samples and sum(s.input_ids_n.numel() for s in samples) == store.num_tokens
    assert [s.sample_id for s in iter_training_samples(store, heldout_fraction=0.5)] == \
        [s.sample_id for s in samples if is_heldout(s.sample_id, 0.5)]
    assert len(list(iter_training_samples(store, max_samples=3))) == 3

    config = DraftConfig.from_target_config(AutoConfig.from_pretrained(tiny_llama), num_layers=1,
                                            mask_token_id=store.settings.mask_token_id,
                                            aux_layer_ids=list(store.settings.aux_layer_ids))
    draft = PEagleDraft(config).eval()
    result = evaluate_offline(draft, iter(samples), 4)
    expected_chains = 0
    for s in samples:
        expected_chains += chain_anchors(s.supervised_T, 4).numel()
    assert result.histogram.num_steps == expected_chains > 0
    assert result.num_samples == len(samples)
    al = result.histogram.acceptance_lengths()
    assert all(1.0 <= a <= k + 1 for k, a in enumerate(al, 1)) and al == sorted(al)
