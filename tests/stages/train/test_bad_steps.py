"""The non-finite guard (step.py, bad_steps.py): a step whose loss or gradient norm is NaN or inf is not
applied -- weights and optimizer state unchanged, gradients zeroed, the schedule advanced -- and is
counted, its samples recorded; past --max-bad-steps the stop line names them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.bad_steps import BAD_STEPS_FILE, BadSteps
from peagle.testing.trainer import trainer_for_draft

sys.path.insert(0, str(Path(__file__).parent))  # sibling test helpers, whatever pytest's import mode
from test_partition_equivalence import K, batch_of, random_items, tiny_draft  # noqa: E402


def guarded_trainer(out: Path, **kw):
    config = TrainConfig.from_flags(store=("unused",), target="unused", out=str(out), num_depths=K, attention="sdpa",
                                    max_steps=4, warmup_steps=0, lr=1e-3, **kw)
    return trainer_for_draft(config, tiny_draft())


def nan_batch(seed: int):
    batch = batch_of(random_items(seed, [30, 20]), 1)
    batch.sources = (("/stores/a", 3), ("/stores/a", 5))
    batch.aux_TAH[4, 0, 0] = float("nan")  # one aux value of the first sample
    return batch


def snapshot(trainer) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}
    optim = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in trainer.step_fn.optimizer.state.items()}
    return params, optim


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_nan_step_is_not_applied_counted_and_recorded(tmp_path, optimizer):
    trainer = guarded_trainer(tmp_path, optimizer=optimizer)
    assert trainer.train_step([batch_of(random_items(1, [40]), 1)]).applied
    params, optim = snapshot(trainer)
    bad = nan_batch(2)
    result = trainer.train_step([bad])
    assert not result.applied and not torch.isfinite(result.grad_norm)
    after_params, after_optim = snapshot(trainer)
    assert all(torch.equal(params[n], after_params[n]) for n in params)  # not one weight moved
    assert optim.keys() == after_optim.keys() and all(
        all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(optim[k].values(),
                                                                                        after_optim[k].values()))
        for k in optim)  # moments and step counts as they were
    assert all(p.grad is None for p in trainer.draft.parameters())
    assert trainer.step == 2 and trainer.step_fn.scheduler.last_epoch == 2  # the schedule advanced
    assert trainer.bad_steps.count == 1 and not trainer.bad_steps.over_budget
    (line,) = [json.loads(x) for x in (tmp_path / BAD_STEPS_FILE).read_text().splitlines()]
    assert line["step"] == 2 and [s["sample_id"] for s in line["samples"]] == list(bad.sample_ids)
    assert [(s["store"], s["shard"]) for s in line["samples"]] == [("/stores/a", 3), ("/stores/a", 5)]
    record = trainer.window_metrics(1.0)  # the bad step's NaN sums stay out of the window
    assert record["bad_steps"] == 1 and record["loss"] is not None and record["loss"] == record["loss"]
    assert trainer.train_step([batch_of(random_items(3, [35]), 1)]).applied  # training goes on
    assert all(torch.isfinite(p).all() for p in trainer.draft.parameters())


def test_a_window_of_only_bad_steps_logs_no_loss(tmp_path):
    trainer = guarded_trainer(tmp_path)
    trainer.train_step([nan_batch(4)])
    record = trainer.window_metrics(1.0)
    assert record["loss"] is None and record["bad_steps"] == 1 and record["grad_norm"] is None


def test_past_the_budget_the_stop_line_names_the_stores_shards_and_samples(tmp_path):
    bad = BadSteps(tmp_path, max_bad_steps=1)
    batch = nan_batch(5)
    bad.record(3, [batch])
    assert not bad.over_budget
    bad.record(7, [batch])
    assert bad.over_budget
    line = str(bad.stop_error(tmp_path / "checkpoints" / "step-00000007"))
    assert "\n" not in line and "2 steps had a non-finite loss or gradient norm, more than --max-bad-steps 1" in line
    assert (f"their batches held store /stores/a shard 00003 ({batch.sample_ids[0]}), store /stores/a shard 00005 "
            f"({batch.sample_ids[1]});") in line
    assert "steps 3, 7" in line and "step-00000007 keeps the last good weights" in line
    bad.resume(3, 1)  # a resume from step 3: its count, and the record cut back to its step
    assert bad.count == 1 and len((tmp_path / BAD_STEPS_FILE).read_text().splitlines()) == 1


def test_max_bad_steps_is_checked():
    with pytest.raises(UserError, match="--max-bad-steps must be >= 0, got -1"):
        TrainConfig.from_flags(store=("s",), target="t", out="o", max_bad_steps=-1)
