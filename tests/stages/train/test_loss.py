"""The forward KL (``divergence_sum``) against a slow, obvious dense implementation; chunking; the chain
acceptance sums."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from peagle.stages.train.loss import (LossStats, agreement_rates, chain_acceptance, chain_acceptance_length,
                                      chunked_loss_sum, divergence_sum)


def forward_kl_sum(draft_logits_NV, target_draft_ids_Nk, target_probs_Nk, supervised_N, depth_N, num_depths):
    """``divergence_sum`` with the forward KL, the default loss."""
    return divergence_sum(draft_logits_NV, target_draft_ids_Nk, target_probs_Nk, supervised_N, depth_N, num_depths)


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
    assert uncovered > 0  # left out of the loss and the counts (compared above)

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


def test_agreement_rates():
    rates = agreement_rates(torch.tensor([3.0, 1.0, 0.0]), torch.tensor([4.0, 2.0, 0.0]))
    assert rates[:2].tolist() == [0.75, 0.5] and math.isnan(float(rates[2]))


def test_chains_accept_their_leading_agreements_and_stop_at_a_missing_target():
    """Per chain, the leading run of agreeing drafts; index E (no usable target) rejects like a miss."""
    correct_E = torch.tensor([True, True, False, True, True, True])  # E = 6
    chains_CK = torch.tensor([[0, 1, 3],    # agree, agree, agree: 3
                              [0, 2, 3],    # agree, miss: 1 (the agreement after the miss is not accepted)
                              [6, 4, 5],    # no target at depth 0: 0
                              [4, 6, 5],    # agree, no target: 1
                              [2, 0, 1]])   # miss first: 0
    stats = chain_acceptance(correct_E, chains_CK)
    assert float(stats.chain_accepted_sum) == 5 and float(stats.chain_count) == 5
    assert float(stats.loss_sum) == 0 and stats.depth_count.tolist() == [0.0] * 3
    assert chain_acceptance_length(5.0, 5.0) == 2.0 and chain_acceptance_length(0.0, 0.0) is None
    # It is not the product of per-depth rates: correlated errors make them differ.
    rates = [float(torch.cat([correct_E, torch.tensor([False])])[chains_CK[:, d]].float().mean()) for d in range(3)]
    assert 1 + sum(math.prod(rates[:d + 1]) for d in range(3)) != pytest.approx(2.0)
    empty = chain_acceptance(correct_E, torch.zeros(0, 3, dtype=torch.long))
    assert float(empty.chain_count) == 0 and float(empty.chain_accepted_sum) == 0


def _chunked_or_not(chunk_rows, hidden, weight, ids, probs, depth, num_depths, *, train_head, scale=2.5):
    """Sums and gradients of ``scale · loss_sum`` (the trainer scales by world / global count)."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(train_head)
    if chunk_rows is None:
        stats = forward_kl_sum(torch.nn.functional.linear(h, w), ids, probs, torch.ones_like(depth, dtype=torch.bool),
                               depth, num_depths)
    else:
        stats, correct = chunked_loss_sum(h, w, ids, probs, depth, num_depths, chunk_rows=chunk_rows)
        assert correct.dtype == torch.bool and correct.shape == depth.shape
        assert torch.equal(correct.float().new_zeros(num_depths).index_add(0, depth, correct.float()),
                           stats.depth_correct)
    (stats.loss_sum * scale).backward()
    return stats, h.grad, w.grad


@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 100])
def test_chunked_equals_unchunked_with_gradients(chunk_rows, train_head):
    generator = torch.Generator().manual_seed(5)
    num, hidden_size, vocab, topk, num_depths = 37, 16, 30, 4, 3
    ids, probs = random_targets(num, vocab, topk, generator)
    hidden, weight = torch.randn(num, hidden_size, generator=generator), torch.randn(vocab, hidden_size, generator=generator)
    depth = torch.randint(0, num_depths, (num,), generator=generator)
    full, h_grad, w_grad = _chunked_or_not(None, hidden, weight, ids, probs, depth, num_depths, train_head=train_head)
    part, h_grad_c, w_grad_c = _chunked_or_not(chunk_rows, hidden, weight, ids, probs, depth, num_depths,
                                               train_head=train_head)
    torch.testing.assert_close(part.to_vector(), full.to_vector(), atol=1e-5, rtol=1e-5)
    assert float(part.depth_count.sum()) == 37 - 3 and float(part.depth_correct.sum()) >= 0  # 3 uncovered rows
    torch.testing.assert_close(h_grad_c, h_grad, atol=1e-5, rtol=1e-5)
    if train_head:
        torch.testing.assert_close(w_grad_c, w_grad, atol=1e-5, rtol=1e-5)
    else:
        assert w_grad is None and w_grad_c is None


def test_chunked_under_bf16_autocast_matches_unchunked():
    """The trainer's CUDA setting (autocast bf16, fp32 hidden and weights), here on the CPU.

    With a unit loss scale the gradients are bitwise the unchunked ones (the same bf16 ops per row);
    with another scale they differ by bf16 rounding only: the unchunked backward rounds
    ``scale · dlogits`` to bf16, the chunked one ``dlogits`` and scales the result in fp32.
    """
    generator = torch.Generator().manual_seed(6)
    ids, probs = random_targets(50, 40, 5, generator)
    hidden, weight = torch.randn(50, 24, generator=generator), torch.randn(40, 24, generator=generator)
    depth = torch.randint(0, 2, (50,), generator=generator)
    for scale, tol in ((1.0, dict(atol=0, rtol=0)), (2.5, dict(atol=0.02, rtol=0.02))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full, h_grad, _ = _chunked_or_not(None, hidden, weight, ids, probs, depth, 2, train_head=False, scale=scale)
            part, h_grad_c, _ = _chunked_or_not(16, hidden, weight, ids, probs, depth, 2, train_head=False, scale=scale)
        torch.testing.assert_close(part.to_vector(), full.to_vector(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h_grad_c, h_grad, **tol)


def test_chunked_without_grad_and_with_no_rows():
    generator = torch.Generator().manual_seed(7)
    ids, probs = random_targets(20, 30, 4, generator)
    hidden, weight = torch.randn(20, 8, generator=generator), torch.randn(30, 8, generator=generator)
    depth = torch.zeros(20, dtype=torch.long)
    with torch.no_grad():
        stats, correct = chunked_loss_sum(hidden, weight, ids, probs, depth, 1, chunk_rows=6)
    want = forward_kl_sum(hidden @ weight.T, ids, probs, torch.ones(20, dtype=torch.bool), depth, 1)
    torch.testing.assert_close(stats.to_vector(), want.to_vector())
    assert float(correct.sum()) == float(want.depth_correct.sum())
    h = hidden[:0].clone().requires_grad_()
    empty, _ = chunked_loss_sum(h, weight, ids[:0], probs[:0], depth[:0], 1)
    empty.loss_sum.backward()
    assert float(empty.loss_sum.detach()) == 0 and h.grad.shape == (0, 8)


def bytes_kept_for_backward(loss_of_hidden, num: int, hidden_size: int, generator: torch.Generator) -> list[int]:
    """Sizes (bytes) of the tensors autograd still keeps for backward once ``loss_of_hidden`` (a
    random [num, hidden_size] non-leaf hidden -> loss stats) has returned: chunk graphs that were
    freed do not count. Runs the backward afterwards, so the graph is whole."""
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    h = torch.randn(num, hidden_size, generator=generator).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = loss_of_hidden(h * 1.0)  # a non-leaf, as the draft's output is
    gc.collect()
    alive = {id(t): t.numel() * t.element_size() for ref in saved if (t := ref()) is not None}
    stats.loss_sum.backward()
    assert h.grad.shape == (num, hidden_size)
    return sorted(alive.values())


def test_chunked_loss_memory_does_not_grow_with_rows_times_vocab():
    """What autograd keeps for backward: [E, H] (the hidden gradient), never [E, V] logits.

    Counted with saved-tensor hooks over the whole loss graph; the unchunked loss keeps logits
    sized E × V, the chunked one nothing that scales with V (the head is frozen here, as by default).
    """
    generator = torch.Generator().manual_seed(8)
    num, hidden_size, vocab = 512, 8, 2048
    ids, probs = random_targets(num, vocab, 4, generator)
    weight = torch.randn(vocab, hidden_size, generator=generator)
    depth = torch.zeros(num, dtype=torch.long)

    def kept_for_backward(chunk_rows) -> list[int]:
        if chunk_rows is None:
            return bytes_kept_for_backward(lambda hidden: forward_kl_sum(
                hidden @ weight.T, ids, probs, torch.ones(num, dtype=torch.bool), depth, 1), num, hidden_size, generator)
        return bytes_kept_for_backward(lambda hidden: chunked_loss_sum(hidden, weight, ids, probs, depth, 1,
                                                                     chunk_rows=chunk_rows)[0], num, hidden_size, generator)

    unchunked, chunked = kept_for_backward(None), kept_for_backward(64)
    assert max(unchunked) >= num * vocab * 4  # the E × V logits are kept for backward
    assert max(chunked) <= num * hidden_size * 4  # the E × H hidden gradient at most
    assert sum(chunked) * 50 < sum(unchunked)


def test_stats_vector_round_trips_and_adds():
    a = LossStats(torch.tensor(1.5), torch.tensor([1.0, 0.5]), torch.tensor([2.0, 1.0]), torch.tensor([3.0, 2.0]),
                torch.tensor(5.0), torch.tensor(4))
    vector = a.to_vector()
    assert vector.tolist() == [1.5, 5.0, 4.0, 1.0, 0.5, 2.0, 1.0, 3.0, 2.0]
    assert (LossStats.from_vector(vector, 2) + a.detach()).to_vector().tolist() == (2 * vector).tolist()
    assert LossStats.zeros(3).to_vector().tolist() == [0.0] * 12


def test_a_vector_of_another_layout_is_refused():
    """An older peagle's window (``2 + 3K``: no chain sums) or another K is never read as this layout."""
    old_layout = torch.zeros(2 + 3 * 4)
    with pytest.raises(ValueError, match="for 4 depths has 15 entries.*this one has 14"):
        LossStats.from_vector(old_layout, 4)
    with pytest.raises(ValueError, match="for 3 depths"):
        LossStats.from_vector(LossStats.zeros(4).to_vector(), 3)


def test_a_bf16_head_alone_gets_its_gradient_summed_in_fp32():
    """FSDP2's bf16 parameters, a trained head and a hidden state that needs no gradient."""
    generator = torch.Generator().manual_seed(9)
    ids, probs = random_targets(64, 30, 4, generator)
    hidden = torch.randn(64, 16, generator=generator)
    depth = torch.zeros(64, dtype=torch.long)
    grads = []
    for chunk_rows in (None, 4):
        weight = torch.randn(30, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
        if chunk_rows is None:
            stats = forward_kl_sum(hidden.to(torch.bfloat16) @ weight.T, ids, probs, torch.ones(64, dtype=torch.bool),
                                   depth, 1)
        else:
            stats, _ = chunked_loss_sum(hidden.to(torch.bfloat16), weight, ids, probs, depth, 1, chunk_rows=chunk_rows)
        stats.loss_sum.backward()
        grads.append(weight.grad)
    assert grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(grads[1].float(), grads[0].float(), atol=2e-2, rtol=2e-2)


def _autograd_chunk(logits, ids, probs, loss):
    """The reference: ``_divergence_terms``' per-row loss and its autograd gradient, in fp32."""
    from peagle.stages.train.loss import ELEMENT_LOSSES

    z = logits.detach().float().requires_grad_()
    ids = ids.long()
    in_vocab = ids >= 0
    counted = in_vocab.any(dim=-1)
    logp = z.gather(1, ids.clamp_min(0)) - torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.where(in_vocab, probs.float(), torch.zeros_like(logp))
    row = ELEMENT_LOSSES[loss](p, logp, in_vocab) * counted.float()
    row.sum().backward()
    return row.detach(), z.grad, counted & (logits.argmax(dim=-1) == ids[:, 0])


@pytest.mark.parametrize("loss", ["forward_kl", "tv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunk_loss_equals_autograd_on_the_reference(loss, dtype):
    from peagle.stages.train.loss import fused_chunk_loss

    generator = torch.Generator().manual_seed(11)
    ids, probs = random_targets(48, 64, 6, generator)
    logits = (torch.randn(48, 64, generator=generator) * 3).to(dtype)
    want_row, want_grad, want_correct = _autograd_chunk(logits, ids, probs, loss)
    grad = logits.clone()
    row, correct = fused_chunk_loss(grad, ids, probs, loss)  # the gradient, written over the logits
    assert grad.dtype == dtype and row.dtype == torch.float32
    torch.testing.assert_close(row, want_row, atol=1e-5, rtol=1e-5)
    assert torch.equal(correct, want_correct)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=1e-2)  # bf16 rounding
    torch.testing.assert_close(grad.float(), want_grad.to(dtype).float(), **tol)
    assert torch.all(grad[:3] == 0)  # rows without a target: no loss, no gradient


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["forward_kl", "tv"])
def test_compiled_fused_chunk_loss_equals_eager_and_compiles_at_most_twice(loss):
    """The trainer compiles the per-chunk pass (dynamic shapes): same numbers, one graph for every
    chunk height (the last chunk of each forward is shorter), bf16 logits as on the GPU."""
    from peagle.stages.train.loss import fused_chunk_loss
    from peagle.stages.train.step import compiled_graph_count

    torch._dynamo.reset()
    compiled = torch.compile(fused_chunk_loss, dynamic=True)
    before = compiled_graph_count()
    generator = torch.Generator().manual_seed(12)
    for rows in (40, 17, 64, 33, 9, 50, 41, 12, 27, 60):
        ids, probs = random_targets(rows, 96, 8, generator)
        logits = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
        eager_grad, compiled_grad = logits.clone(), logits.clone()
        want_row, want_correct = fused_chunk_loss(eager_grad, ids, probs, loss)
        got_row, got_correct = compiled(compiled_grad, ids, probs, loss)
        torch.testing.assert_close(got_row, want_row, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_correct, want_correct)
        torch.testing.assert_close(compiled_grad.float(), eager_grad.float(), atol=4e-3, rtol=1e-2)
    assert 1 <= compiled_graph_count() - before <= 2


def test_a_passed_compute_copy_of_the_head_changes_nothing():
    """The trainer hands the loss a cached bf16 copy of a frozen head instead of a cast per chunk."""
    from peagle.stages.train.loss import compute_weight

    generator = torch.Generator().manual_seed(13)
    ids, probs = random_targets(30, 20, 4, generator)
    hidden, weight = torch.randn(30, 8, generator=generator), torch.randn(20, 8, generator=generator)
    depth = torch.zeros(30, dtype=torch.long)
    results = []
    for passed in (False, True):
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            copy = compute_weight(weight) if passed else None
            assert copy is None or copy.dtype == torch.bfloat16
            stats, _ = chunked_loss_sum(h, weight, ids, probs, depth, 1, chunk_rows=7, head_compute_VH=copy)
        stats.loss_sum.backward()
        results.append((stats.to_vector(), h.grad))
    torch.testing.assert_close(results[1][0], results[0][0], atol=0, rtol=0)
    torch.testing.assert_close(results[1][1], results[0][1], atol=0, rtol=0)
