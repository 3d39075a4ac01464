"""The total-variation loss (``--loss tv``): chunked sums and gradients against a slow, obvious dense
implementation (torch autograd on the full logits), its link to speculative sampling's acceptance
probability, and the chunked memory bound it keeps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from peagle.schemas.train_config import LOSSES
from peagle.stages.train.loss import ELEMENT_LOSSES, chunked_loss_sum, divergence_sum
sys.path.insert(0, str(Path(__file__).parent))  # sibling test helpers, whatever pytest's import mode
from test_loss import bytes_kept_for_backward, random_targets  # noqa: E402


def dense_target(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, V]`` float64 target: the renormalised top-k probabilities at their draft ids, 0 elsewhere."""
    target = torch.zeros(ids.shape[0], vocab, dtype=torch.float64)
    for i in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            if ids[i, j] >= 0:
                target[i, ids[i, j]] += float(probs[i, j])
    return target


def dense_tv(hidden, weight, ids, probs, depth, num_depths):
    """The definition on full float64 logits: ½ Σ_v |p_v - softmax(logits)_v| per covered row, summed;
    rows without an in-vocab id are dropped, as the trainer drops them."""
    logits = hidden.double() @ weight.double().T
    q = torch.softmax(logits, dim=-1)
    covered = (ids >= 0).any(dim=-1)
    tv = 0.5 * (dense_target(ids, probs, weight.shape[0]) - q).abs().sum(dim=-1)
    tv = torch.where(covered, tv, torch.zeros_like(tv))
    depth_loss = torch.zeros(num_depths, dtype=torch.float64).index_add(0, depth, tv.detach())
    correct = covered & (logits.argmax(dim=-1) == ids[:, 0])
    depth_correct = torch.zeros(num_depths, dtype=torch.float64).index_add(0, depth, correct.double())
    depth_count = torch.zeros(num_depths, dtype=torch.float64).index_add(0, depth, covered.double())
    return tv.sum(), depth_loss, depth_correct, depth_count, correct


@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 7, 41, 100])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_tv_and_its_gradients_equal_dense_autograd(chunk_rows, train_head, seed):
    generator = torch.Generator().manual_seed(seed)
    num, hidden_size, vocab, topk, num_depths = 41, 16, 30, 5, 3
    ids, probs = random_targets(num, vocab, topk, generator)
    hidden = torch.randn(num, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) / 2
    depth = torch.randint(0, num_depths, (num,), generator=generator)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_head)
    stats, correct_rows = chunked_loss_sum(h, w, ids, probs, depth, num_depths, chunk_rows=chunk_rows, loss="tv")
    (stats.loss_sum * 2.5).backward()
    h_ref, w_ref = hidden.double().requires_grad_(), weight.double().requires_grad_(train_head)
    loss, depth_loss, correct, count, dense_correct_rows = dense_tv(h_ref, w_ref, ids, probs, depth, num_depths)
    (loss * 2.5).backward()

    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.loss_sum.double(), loss.detach(), **tol)
    torch.testing.assert_close(stats.depth_loss_sum.double(), depth_loss, **tol)
    assert stats.depth_correct.double().tolist() == correct.tolist()
    assert stats.depth_count.double().tolist() == count.tolist()
    assert correct_rows.tolist() == dense_correct_rows.tolist()  # rows without a target never agree
    assert int((~(ids >= 0).any(dim=-1)).sum()) == 3
    torch.testing.assert_close(h.grad.double(), h_ref.grad, **tol)
    if train_head:
        torch.testing.assert_close(w.grad.double(), w_ref.grad, **tol)
    else:
        assert w.grad is None


def test_tv_is_one_minus_the_acceptance_probability_and_bounded():
    """Speculative sampling accepts a draft token with probability Σ_v min(p_v, q_v) = 1 - TV(p, q)."""
    generator = torch.Generator().manual_seed(3)
    ids, probs = random_targets(30, 25, 4, generator)
    logits = 4 * torch.randn(30, 25, generator=generator, dtype=torch.float64)
    per_row = [float(divergence_sum(logits[i:i + 1], ids[i:i + 1], probs[i:i + 1], torch.ones(1, dtype=torch.bool),
                                    torch.zeros(1, dtype=torch.long), 1, loss="tv").loss_sum) for i in range(30)]
    q = torch.softmax(logits, dim=-1)
    acceptance = torch.minimum(dense_target(ids, probs, 25), q).sum(dim=-1)
    covered = (ids >= 0).any(dim=-1)
    for i in range(30):
        assert 0.0 <= per_row[i] <= 1.0
        if covered[i]:
            assert per_row[i] == pytest.approx(1.0 - float(acceptance[i]), abs=1e-6)


def test_tv_is_zero_when_the_draft_is_the_renormalised_target():
    ids = torch.tensor([[2, 0, -1], [1, -1, -1]])
    probs = torch.tensor([[0.75, 0.25, 0.0], [1.0, 0.0, 0.0]])
    logits = torch.log(torch.tensor([[0.25, 1e-30, 0.75], [1e-30, 1.0, 1e-30]]))
    stats = divergence_sum(logits, ids, probs, torch.tensor([True, True]), torch.tensor([0, 1]), 2, loss="tv")
    assert abs(float(stats.loss_sum)) < 1e-6 and stats.depth_correct.tolist() == [1.0, 1.0]


def test_chunked_tv_keeps_nothing_sized_rows_times_vocab():
    """The memory bound of chunked_loss_sum holds for TV too: only [E, H] survives the forward."""
    generator = torch.Generator().manual_seed(8)
    num, hidden_size, vocab = 512, 8, 2048
    ids, probs = random_targets(num, vocab, 4, generator)
    weight = torch.randn(vocab, hidden_size, generator=generator)
    alive = bytes_kept_for_backward(lambda hidden: chunked_loss_sum(
        hidden, weight, ids, probs, torch.zeros(num, dtype=torch.long), 1, chunk_rows=64, loss="tv")[0],
        num, hidden_size, generator)
    assert max(alive) <= num * hidden_size * 4


def test_a_tv_run_learns_and_reports_per_depth_stats(tmp_path, tiny_store):
    """`peagle train --loss tv` in process: the logged loss (and the eval's) is the TV, in [0, 1]."""
    from peagle.stages.train.loop import run_training
    from test_loop import metrics, run_config

    out = tmp_path / "tv"
    run_training(run_config(tiny_store, out, loss="tv"))
    records = metrics(out)
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] and all(0 < r["loss"] <= 1 for r in records if "loss" in r)
    for r in train:
        assert len(r["depth_loss"]) == len(r["depth_agreement"]) == 4 and r["depth_count"][0] > 0
        assert all(0 <= d <= 1 for d in r["depth_loss"] if d is not None)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]


def test_every_loss_flag_has_an_implementation():
    assert tuple(ELEMENT_LOSSES) == LOSSES
