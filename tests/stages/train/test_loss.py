"""forward_kl_sum against a slow, obvious dense implementation; the acceptance-length estimate."""

from __future__ import annotations

import math

import pytest
import torch

from peagle.stages.train.loss import (acceptance_length_estimate, agreement_rates, forward_kl_sum,
                                      forward_kl_sum_chunked)


def random_targets(num: int, vocab: int, topk: int, generator: torch.Generator):
    """Top-k draft ids (-1 for ids outside the draft vocab) with renormalised probabilities, like
    the trainer builds them from the store: column 0 is the target's argmax."""
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:topk] for _ in range(num)])
    out_of_vocab = torch.rand(num, topk, generator=generator) < 0.3
    out_of_vocab[:3] = True  # rows with no draft-vocab id at all
    out_of_vocab[3, 0] = True  # the argmax is outside the draft vocab, others are not
    out_of_vocab[3, 1:] = False
    ids = torch.where(out_of_vocab, -1, ids)
    raw = torch.rand(num, topk, generator=generator).sort(dim=-1, descending=True).values
    probs = torch.where(ids >= 0, raw, 0.0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
    return ids, probs


def dense_reference(logits, ids, probs, weight, depth, num_depths):
    """Loop over elements with a dense target distribution: the definition, nothing clever."""
    loss = torch.zeros(())
    depth_loss, correct, count = [0.0] * num_depths, [0] * num_depths, [0] * num_depths
    uncovered = 0
    for i in range(logits.shape[0]):
        if weight[i] <= 0:
            continue
        if not (ids[i] >= 0).any():
            uncovered += 1
            continue
        target = torch.zeros(logits.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            if ids[i, j] >= 0:
                target[ids[i, j]] += probs[i, j].double()
        log_q = torch.log_softmax(logits[i].double(), dim=-1)
        kl = sum(t * (math.log(t) - log_q[v]) for v, t in enumerate(target.tolist()) if t > 0)
        loss = loss + weight[i] * kl
        d = int(depth[i])
        depth_loss[d] += float(weight[i] * kl.detach() if torch.is_tensor(kl) else weight[i] * kl)
        count[d] += 1
        correct[d] += int(ids[i, 0] >= 0 and int(logits[i].argmax()) == int(ids[i, 0]))
    return loss, depth_loss, correct, count, uncovered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_kl_matches_dense_reference(dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    num, vocab, topk, num_depths = 40, 50, 6, 4
    ids, probs = random_targets(num, vocab, topk, generator)
    logits = (3 * torch.randn(num, vocab, generator=generator)).to(dtype)
    weight = (torch.rand(num, generator=generator) < 0.8).float() * torch.rand(num, generator=generator).add(0.5)
    depth = torch.randint(0, num_depths, (num,), generator=generator)
    # Make some draft argmaxes agree with the target so that agreement counts are not all zero.
    agree = torch.nonzero(ids[:, 0] >= 0).flatten()[::2]
    logits[agree, ids[agree, 0]] = 100.0

    logits_leaf = logits.to(dtype).clone().requires_grad_()
    stats = forward_kl_sum(logits_leaf, ids, probs, weight, depth, num_depths)
    ref_logits = logits.to(dtype).double().clone().requires_grad_()
    ref_loss, depth_loss, correct, count, uncovered = dense_reference(ref_logits, ids, probs, weight, depth, num_depths)

    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stats.loss_sum.double(), ref_loss, **tol)
    torch.testing.assert_close(stats.depth_loss_sum.double(), torch.tensor(depth_loss, dtype=torch.float64), **tol)
    assert stats.depth_correct.tolist() == correct and sum(correct) > 0
    assert stats.depth_count.tolist() == count
    assert int(stats.num_uncovered) == uncovered > 0

    stats.loss_sum.backward()
    ref_loss.backward()
    grad_tol = tol if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # grads come back in bf16
    torch.testing.assert_close(logits_leaf.grad.double(), ref_logits.grad, **grad_tol)


def test_bool_mask_and_exact_match_give_zero_kl():
    ids = torch.tensor([[2, 0, -1], [1, -1, -1]])
    probs = torch.tensor([[0.75, 0.25, 0.0], [1.0, 0.0, 0.0]])
    target_logp = torch.log(torch.tensor([[0.25, 1e-30, 0.75], [1e-30, 1.0, 1e-30]]))
    stats = forward_kl_sum(target_logp, ids, probs, torch.tensor([True, True]), torch.tensor([0, 1]), 2)
    assert abs(float(stats.loss_sum)) < 1e-6
    assert stats.depth_correct.tolist() == [1.0, 1.0] and stats.depth_count.tolist() == [1.0, 1.0]


def test_acceptance_length_estimate_is_the_chain_product():
    assert acceptance_length_estimate([1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert acceptance_length_estimate([0.5, 0.5]) == pytest.approx(1.75)
    assert acceptance_length_estimate([0.8, 0.5, float("nan"), 1.0]) == pytest.approx(1 + 0.8 + 0.4)
    assert acceptance_length_estimate(torch.zeros(3)) == pytest.approx(1.0)
    rates = agreement_rates(torch.tensor([3.0, 1.0, 0.0]), torch.tensor([4.0, 2.0, 0.0]))
    assert rates[:2].tolist() == [0.75, 0.5] and math.isnan(float(rates[2]))


def test_chunked_equals_unchunked_with_gradients():
    generator = torch.Generator().manual_seed(5)
    num, hidden_size, vocab, topk = 37, 16, 30, 4
    ids, probs = random_targets(num, vocab, topk, generator)
    hidden = torch.randn(num, hidden_size, generator=generator)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    supervised = torch.rand(num, generator=generator) < 0.7
    depth = torch.randint(0, 3, (num,), generator=generator)

    results = []
    for chunked in (False, True):
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        if chunked:
            stats = forward_kl_sum_chunked(head, h, ids, probs, supervised, depth, 3, chunk_size=8)
        else:
            stats = forward_kl_sum(head(h), ids, probs, supervised, depth, 3)
        stats.loss_sum.backward()
        results.append((stats, h.grad.clone(), head.weight.grad.clone()))
    (full, h_grad, w_grad), (part, h_grad_c, w_grad_c) = results
    for field in ("loss_sum", "depth_loss_sum", "depth_correct", "depth_count", "num_uncovered"):
        torch.testing.assert_close(getattr(part, field).float(), getattr(full, field).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_grad_c, h_grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_grad_c, w_grad, atol=1e-6, rtol=1e-5)
