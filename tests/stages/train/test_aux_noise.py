"""``--aux-noise``: relative noise on the aux states in training only, drawn so a resumed run is exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.aux_noise import noised
from peagle.stages.train.loop import run_training
from peagle.testing.trainer import trainer_for_draft

sys.path.insert(0, str(Path(__file__).parent))  # sibling test helpers, whatever pytest's import mode
from test_loop import assert_resume_reproduces, metrics, run_config  # noqa: E402
from test_partition_equivalence import K, batch_of, random_items, tiny_draft  # noqa: E402


def test_the_noise_is_a_fraction_of_each_states_rms_whatever_its_scale():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)  # three aux layers of very different sizes
    aux = torch.randn(2000, 3, 64, generator=g) * scales
    torch.manual_seed(1)
    out = noised(aux, 0.25)
    rms = aux.pow(2).mean(-1, keepdim=True).sqrt()
    relative = (out - aux) / rms
    assert relative.mean().abs() < 0.01
    for layer in range(3):  # the same relative spread in every layer
        assert relative[:, layer].std().item() == pytest.approx(0.25, rel=0.02)
    torch.manual_seed(1)
    assert ((noised(aux * 7, 0.25) - out * 7).abs() / (rms * 7)).max() < 1e-5  # scale-free
    low = aux.to(torch.bfloat16)
    assert noised(low, 0.25).dtype == torch.bfloat16 and noised(low, 0.25).shape == low.shape


def _step_loss(aux_noise: float, *, training: bool, seed: int) -> float:
    config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", num_depths=K, attention="sdpa",
                                    max_steps=1, aux_noise=aux_noise)
    trainer = trainer_for_draft(config, tiny_draft())
    batch = batch_of(random_items(3, [40, 17]), 1)
    torch.manual_seed(seed)
    if not training:
        stats, _ = trainer.step_fn.evaluate([batch])
    else:
        stats, _ = trainer.step_fn.forward_backward([batch])
    return float(stats.loss_sum)


def test_training_reads_noised_states_and_evaluation_the_real_ones():
    plain = _step_loss(0.0, training=True, seed=0)
    assert _step_loss(0.5, training=True, seed=0) != plain  # the step saw other inputs
    assert _step_loss(0.5, training=True, seed=0) == _step_loss(0.5, training=True, seed=0)  # from the RNG
    assert _step_loss(0.5, training=False, seed=0) == _step_loss(0.0, training=False, seed=5)  # never in eval


def test_a_noised_run_resumes_exactly(tiny_store, tmp_path):
    straight = tmp_path / "straight"
    run_training(run_config(tiny_store, straight, aux_noise=0.3))
    plain = tmp_path / "plain"
    run_training(run_config(tiny_store, plain, max_steps=2))
    assert [r["loss"] for r in metrics(straight)[:2]] != [r["loss"] for r in metrics(plain)[:2]]

    resumed = tmp_path / "resumed"
    assert_resume_reproduces(straight, resumed, run_config(tiny_store, straight, aux_noise=0.3))
    with pytest.raises(UserError, match=r"--aux-noise was 0.3 in the checkpointed run and is 0.0 now"):
        run_training(run_config(tiny_store, resumed, max_steps=5))
    with pytest.raises(UserError, match=r"--aux-noise must be >= 0, got -0.1"):
        run_config(tiny_store, resumed, aux_noise=-0.1)
