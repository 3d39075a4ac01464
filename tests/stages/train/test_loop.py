"""The trainer in-process on a real tiny store: steps, metrics, eval, checkpoints, exact resume."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from peagle.model.draft import PEagleDraft
from peagle.pipeline import checkpoint_files as cf
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train import checkpoint as ckpt
from peagle.stages.train.loop import Trainer, run_training
from peagle.stages.train.optim import lr_factor
from peagle.stages.train.attention import SDPA_PER_DOCUMENT, resolve_attention
sys.path.insert(0, str(Path(__file__).parent))  # sibling test helpers, whatever pytest's import mode
from test_partition_equivalence import (assert_same, batch_of, loss_and_grads, random_items, tiny_draft,  # noqa: E402
                                        trainer_for)


def test_lr_warms_up_then_decays_to_a_tenth():
    factors = [lr_factor(s, 4, 20) for s in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:])) and lr_factor(20, 4, 20) == pytest.approx(0.1)


def test_attention_auto_is_sdpa_on_cpu_and_flex_is_refused_there():
    assert resolve_attention("auto", torch.device("cpu")) == SDPA_PER_DOCUMENT == resolve_attention("sdpa", torch.device("cpu"))
    assert resolve_attention("sdpa", torch.device("cuda", 0)) == "sdpa"
    assert resolve_attention("auto", torch.device("cuda", 0)) == "flex"
    with pytest.raises(UserError, match="--attention flex needs a CUDA device"):
        resolve_attention("flex", torch.device("cpu"))


def test_micro_batches_are_not_averaged_one_count_normalises_the_step():
    """Two micro-batches give the loss and gradients of one batch packing the same samples."""
    a, b = random_items(7, [40, 13]), random_items(8, [29])
    assert_same(loss_and_grads([a + b], 1), loss_and_grads([a, b], 1))


def test_activation_checkpointing_changes_memory_not_results():
    micro = [random_items(9, [45, 20])]
    assert_same(loss_and_grads(micro, 2), loss_and_grads(micro, 2, activation_checkpointing=True))


def test_the_checkpointed_metrics_window_resumes_and_an_older_layout_is_dropped_not_misread(capsys):
    """The window's stats vector comes back as it was; one of an older peagle (``2 + 3K`` entries, no
    chain sums) is not read as today's layout: the resumed run starts its window afresh and says so."""
    trainer = trainer_for(tiny_draft(), 1)
    trainer.train_step([batch_of(random_items(3, [40, 30]), 1)])
    state = trainer.state_dict()
    saved = state[ckpt.TRAIN_STATE]["window"]["stats"]
    assert float(trainer.window.stats.chain_count) > 0
    fresh = trainer_for(tiny_draft(), 1)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.window.stats.to_vector(), saved)
    K = trainer.config.cod.num_depths
    state[ckpt.TRAIN_STATE]["window"]["stats"] = torch.ones(2 + 3 * K)
    older = trainer_for(tiny_draft(), 1)
    older.load_state_dict(state)
    assert older.window.stats.to_vector().tolist() == [0.0] * (3 + 3 * K) and older.step == 1
    assert "metrics window has another layout" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Whole runs on the tiny store (identity draft vocab: no vocab files needed)


def run_config(tiny, out, **kw) -> TrainConfig:
    base = dict(store=(str(tiny.root),), target=str(tiny.target_dir), out=str(out), num_layers=1, num_depths=4,
                token_budget=256, draft_vocab_size=tiny.vocab_size, max_steps=4, lr=2e-3, warmup_steps=1,
                log_every=1, save_every=2, eval_every=2, heldout_fraction=0.25, num_workers=0)
    return TrainConfig.from_flags(**{**base, **kw})


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_store):
    out = tmp_path_factory.mktemp("runs") / "straight"
    run_training(run_config(tiny_store, out))
    return out


def test_a_run_writes_metrics_evals_and_checkpoints(finished_run):
    records = metrics(finished_run)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert math.isfinite(r["loss"]) and r["loss"] > 0 and 0 <= r["data_wait_share"] <= 1
        assert len(r["depth_loss"]) == len(r["depth_agreement"]) == len(r["depth_count"]) == 4
        assert r["depth_count"][0] > 0 and r["tokens_per_s"] > 0 and r["acceptance_length_estimate"] >= 1
    assert train[-1]["loss"] < train[0]["loss"]  # it learns
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]
    assert [p.name for p in cf.list_checkpoints(finished_run)] == ["step-00000002", "step-00000004"]
    run_info = json.loads((finished_run / "run.json").read_text())
    assert run_info["train_config"]["max_steps"] == 4 and run_info["draft_config"]["num_layers"] == 1


def test_python_and_numpy_rngs_start_from_the_seed(finished_run):
    """Nothing in training draws from them, so the checkpoint holds the states right after the rank's
    own seeding (seed 0, rank 0: ``rank_seed(0, 0)``, once the draft is built)."""
    import random

    import numpy as np

    saved = ckpt.load_checkpoint(cf.list_checkpoints(finished_run)[0])[ckpt.RNG]
    ckpt.seed_rngs(12345)
    ckpt.set_rng_state(saved)
    seed = ckpt.rank_seed(0, 0)
    assert random.getstate() == random.Random(seed).getstate()
    name, keys, pos, *_ = np.random.get_state()
    assert np.array_equal(keys, np.random.RandomState(seed % 2**32).get_state()[1]) and pos == 624


def test_the_checkpoint_holds_the_unwrapped_draft(finished_run):
    from peagle.schemas.draft_config import DraftConfig

    path = cf.latest_valid_checkpoint(finished_run)
    state = ckpt.load_checkpoint(path)
    fresh = PEagleDraft(DraftConfig.from_dict(state[ckpt.CONFIG]["draft_config"]))
    assert set(state[ckpt.MODEL]) == set(fresh.state_dict())
    assert state[ckpt.TRAIN_STATE]["step"] == 4 and state[ckpt.TRAIN_STATE]["tokens_seen"] > 0


def test_training_records_its_own_provenance(finished_run):
    """The revision and host of the process that trained (export copies this, not its own)."""
    from peagle.pipeline.provenance import git_revision
    from peagle.schemas.checkpoint import PROVENANCE_KEY

    recorded = ckpt.load_checkpoint(cf.latest_valid_checkpoint(finished_run))[ckpt.CONFIG][PROVENANCE_KEY]
    assert recorded["git_revision"] == git_revision() and recorded["peagle_version"]
    assert recorded["host"]["torch"] == torch.__version__
    assert json.loads((finished_run / "run.json").read_text())[PROVENANCE_KEY] == recorded


def assert_resume_reproduces(finished: Path, out: Path, config: TrainConfig) -> None:
    """Copy ``finished`` (a 4-step run of ``config``) to ``out`` as if killed after its step-2
    checkpoint, with a half-written metrics tail, resume it under ``config``: the same metrics but
    timings, and the same step-4 weights bit for bit."""
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints" / "step-00000004")  # as if killed after the step-2 checkpoint
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "loss": 123.0}\n{"kind": "tra')  # a half-written tail
    run_training(dataclasses.replace(config, out=str(out)))
    assert metrics(out) == [r | ({} if r["kind"] == "eval" else {k: r2[k] for k in TIMING})
                            for r, r2 in zip(metrics(finished), metrics(out))]
    a = torch.load(finished / "checkpoints" / "step-00000004" / "model.pt")
    b = torch.load(out / "checkpoints" / "step-00000004" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_from_an_earlier_checkpoint_reproduces_the_run(finished_run, tmp_path, tiny_store):
    assert_resume_reproduces(finished_run, tmp_path / "resumed", run_config(tiny_store, finished_run))


TIMING = ("tokens_per_s", "data_wait_share", "step_time_s")


def test_resume_refuses_a_changed_setting_and_allows_more_steps(finished_run, tmp_path, tiny_store, capsys):
    out = tmp_path / "changed"
    shutil.copytree(finished_run, out)
    with pytest.raises(UserError, match=r"--lr was 0.002 in the checkpointed run and is 0.001 now"):
        run_training(run_config(tiny_store, out, lr=1e-3))
    run_training(run_config(tiny_store, out, max_steps=5))
    assert [r["step"] for r in metrics(out) if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    run_training(run_config(tiny_store, out, max_steps=5))  # finished: nothing to do
    assert "nothing to do" in capsys.readouterr().err


def test_bf16_compute_on_cpu_trains_finite_steps_and_a_resume_may_not_change_it(tiny_store, tmp_path, capsys):
    out = tmp_path / "bf16"
    run_training(run_config(tiny_store, out, max_steps=2, compute_dtype="bf16"))  # any dtype spelling
    assert "compute bfloat16" in capsys.readouterr().err
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)
    with pytest.raises(UserError, match=r"--compute-dtype was 'bfloat16' in the checkpointed run and is 'float32' now"):
        run_training(run_config(tiny_store, out, max_steps=3, compute_dtype="float32"))
    with pytest.raises(UserError, match=r"--compute-dtype must be one of auto, float32 \(fp32"):
        run_config(tiny_store, out, compute_dtype="int8")


def test_epochs_become_a_step_count(tiny_store, tmp_path):
    trainer = Trainer(run_config(tiny_store, tmp_path / "e", max_steps=None, epochs=1.0, grad_accum=2))
    trainer.build()
    try:
        assert trainer.total_steps == trainer.loader.num_batches // 2
    finally:
        trainer.close()


def test_store_and_vocab_errors_are_one_line(tiny_store, tmp_path):
    with pytest.raises(UserError, match="has no draft vocab of size 200; build it with `peagle vocab"):
        Trainer(run_config(tiny_store, tmp_path / "v", draft_vocab_size=200)).build()
    with pytest.raises(UserError, match="is not a peagle store"):
        Trainer(run_config(tiny_store, tmp_path / "v", store=(str(tmp_path),))).build()
    with pytest.raises(UserError, match="target model directory .* has no config.json"):
        Trainer(run_config(tiny_store, tmp_path / "v", target=str(tmp_path))).build()


def test_a_same_shaped_target_with_other_weights_is_refused(tiny_store, tmp_path):
    from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target

    other = build_tiny_target(tmp_path / "other", TinyTargetSpec(arch="llama", seed=7))
    with pytest.raises(UserError) as err:
        Trainer(run_config(tiny_store, tmp_path / "w", target=str(other))).build()
    line = str(err.value)
    assert "\n" not in line and "has other weights" in line
    assert f"from target {Path(tiny_store.target_dir).resolve()}" in line and f"--target {other} " in line
