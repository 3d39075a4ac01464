"""The CUDA path of training (``pytest -m cuda``; skipped without a CUDA device).

On a GPU these check what the CPU suite cannot: compiled flex attention's loss and gradients
against SDPA (bf16 autocast, fp32 master weights), the decoder layers compiled whole (Triton, flex
inside) against flex compiled alone, the flex kernel options and fp8 matmuls against the default,
a step on batches copied on the side stream against one on host batches, the BlockMask built from
the loader workers' indices against ``create_block_mask`` on the device, that a step issues no host
sync before the optimizer (``torch.cuda.set_sync_debug_mode("error")``), and kill -9 + resume
through the real CLI.
Batches come from the real loader over the real tiny store, pinned by the DataLoader's pin thread.
benchmarks/gpu_suite.sh runs them and records the counts (``cuda_tests`` in its summary).
"""

from __future__ import annotations

import json
import signal

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers import AutoConfig

from peagle.model.draft import build_draft_from_target
from peagle.model.mask import block_mask_from_indices, peagle_mask_mod
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.train_config import StoreSpec, TrainConfig
from peagle.stages.train.batch import CodSettings
from peagle.stages.train.loader import LoaderConfig, TrainLoader
from peagle.stages.train.device import DevicePrefetcher
from peagle.stages.train.loop import Trainer
from peagle.testing import tracker_readers
from peagle.testing.trainer import trainer_for_draft
from peagle.pipeline.tracking.preflight import plan_tracking
from peagle.pipeline.tracking.tracker import open_tracker
from peagle.schemas.tracking_config import TrackingOptions
from peagle.stages.train.optim import clip_and_step

pytestmark = pytest.mark.cuda

BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _batches(tiny_store, count: int, *, partitions: int = 1, epoch: int = 0) -> list:
    config = LoaderConfig(stores=(StoreSpec(str(tiny_store.root)),), token_budget=256, attention="flex",
                          block_size=128, cod=CodSettings(num_depths=4), sequence_partitions=partitions,
                          num_workers=1, pin_memory=True)
    batches = list(TrainLoader(config).batches(epoch))[:count]
    assert len(batches) == count and all(b.aux_TAH.is_pinned() for b in batches)
    return batches


def _trainer(tiny_store, attention: str, partitions: int = 1, **options) -> Trainer:
    hf_config = AutoConfig.from_pretrained(tiny_store.target_dir)
    draft_config = DraftConfig.from_target_config(hf_config, num_layers=2, mask_token_id=tiny_store.mask_token_id)
    torch.manual_seed(0)
    draft = build_draft_from_target(tiny_store.target_dir, draft_config, train_lm_head=True)
    config = TrainConfig.from_flags(store=(str(tiny_store.root),), target=str(tiny_store.target_dir), out="unused",
                                    num_depths=4, sequence_partitions=partitions, attention=attention, max_steps=10,
                                    lr=1e-3, warmup_steps=0, **options)
    trainer = trainer_for_draft(config, draft)
    assert trainer.device.type == "cuda" and trainer.step_fn.compute_dtype == torch.bfloat16
    return trainer


@pytest.mark.parametrize("partitions", [1, 2])
def test_flex_and_sdpa_give_the_same_loss_and_gradients(tiny_store, partitions):
    batches = _batches(tiny_store, 2, partitions=partitions)
    results = {}
    for attention in ("flex", "sdpa"):
        trainer = _trainer(tiny_store, attention, partitions)
        stats, (count, _, _) = trainer.step_fn.forward_backward(batches)
        grads = {name: p.grad.float().clone() for name, p in trainer.draft.named_parameters() if p.grad is not None}
        results[attention] = (float(stats.loss_sum) / count, grads)
        compiler = trainer.step_fn.compiler
        assert compiler.mode == "layers" and compiler.fallback_reason is None, compiler.describe()
    (flex_loss, flex_grads), (sdpa_loss, sdpa_grads) = results["flex"], results["sdpa"]
    assert flex_loss == pytest.approx(sdpa_loss, rel=1e-2)
    assert flex_grads.keys() == sdpa_grads.keys() and len(flex_grads) == len(list(trainer.draft.parameters()))
    for name, want in sdpa_grads.items():  # bf16 attention in both, different kernels: relative error
        error = float((flex_grads[name] - want).norm() / want.norm().clamp_min(1e-12))
        assert error < 3e-2, f"{name}: relative gradient difference {error:.3g}"


def _loss_and_grads(trainer: Trainer, batches: list) -> tuple[float, dict]:
    trainer.step_fn.optimizer.zero_grad(set_to_none=True)
    stats, (count, _, _) = trainer.step_fn.forward_backward(batches)
    grads = {name: p.grad.float().clone() for name, p in trainer.draft.named_parameters() if p.grad is not None}
    return float(stats.loss_sum) / count, grads


def _assert_close(got: tuple[float, dict], want: tuple[float, dict], rel: float) -> None:
    assert got[0] == pytest.approx(want[0], rel=rel)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        error = float((got[1][name] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert error < 3 * rel, f"{name}: relative gradient difference {error:.3g}"


@pytest.mark.parametrize("options", [{"compile": "flex"}, {"flex_kernel": "rows-safe"}, {"flex_kernel": "tma"}],
                         ids=lambda o: next(iter(o.values())))
def test_compiled_layers_and_kernel_options_compute_what_the_default_does(tiny_store, options):
    batches = _batches(tiny_store, 2, partitions=2)
    want = _loss_and_grads(_trainer(tiny_store, "flex", 2), batches)
    other = _trainer(tiny_store, "flex", 2, **options)
    _assert_close(_loss_and_grads(other, batches), want, rel=1e-2)
    assert other.step_fn.compiler.fallback_reason is None, other.step_fn.compiler.describe()


def test_fp8_matmuls_train_within_fp8_error_of_bf16(tiny_store):
    pytest.importorskip("torchao.float8")
    batches = _batches(tiny_store, 2)
    want = _loss_and_grads(_trainer(tiny_store, "flex"), batches)
    fp8 = _trainer(tiny_store, "flex", fp8_matmuls=True)
    assert "fp8 matmuls" in fp8.step_fn.describe()
    _assert_close(_loss_and_grads(fp8, batches), want, rel=5e-2)


def test_batches_copied_on_the_side_stream_give_the_step_of_host_batches(tiny_store):
    batches = _batches(tiny_store, 3)
    results = []
    for prefetch in (False, True):
        trainer = _trainer(tiny_store, "flex")
        steps = iter([[b] for b in batches])
        source = DevicePrefetcher(steps, trainer.device) if prefetch else steps
        losses = []
        for micro_batches in source:
            if prefetch:
                assert all(b.aux_TAH.is_cuda for b in micro_batches)
            trainer.train_step(micro_batches)
            losses.append(trainer.window_metrics(1.0)["loss"])
        results.append(losses)
    assert results[1] == pytest.approx(results[0], rel=1e-5)


def test_block_mask_from_loader_indices_equals_create_block_mask_on_the_device(tiny_store):
    checked = 0
    for batch in _batches(tiny_store, 3, partitions=2) + _batches(tiny_store, 2):
        b = batch.to("cuda", non_blocking=True)
        for unit in b.units:
            idx = unit.element_idx_M

            def pick(t):
                return t if idx is None else t[idx]

            mask_mod = peagle_mask_mod(pick(b.anchor_N), pick(b.depth_N), pick(b.doc_N))
            assert unit.block_indices.kv_indices.is_cuda
            ours = block_mask_from_indices(unit.block_indices, mask_mod, device="cuda")
            n = pick(b.anchor_N).numel()
            want = create_block_mask(mask_mod, None, None, n, n, device="cuda", BLOCK_SIZE=128)
            for field in BLOCK_FIELDS:
                got, expected = getattr(ours, field), getattr(want, field)
                assert got.device.type == "cuda" and got.dtype == expected.dtype and got.shape == expected.shape
                assert torch.equal(got, expected), field
            assert ours.seq_lengths == want.seq_lengths
            checked += 1
    assert checked >= 8


def test_a_step_does_not_sync_with_the_host_before_the_optimizer_is_done(tiny_store, tmp_path):
    """Also with a tracker on (--logger tensorboard, where installed): handing it the last metrics line
    while the next step is in flight syncs nothing (the line is host numbers; the writes are its thread's)."""
    trainer = _trainer(tiny_store, "flex")
    warmup, timed = _batches(tiny_store, 2), _batches(tiny_store, 1, epoch=1)
    for batch in warmup:  # compiling (and autotuning) may sync; the steady state may not
        trainer.train_step([batch])
    record = {**trainer.window_metrics(1.0), "epoch": 0}  # the logged step's one host read
    tracker = _tensorboard_tracker(tmp_path)
    torch.cuda.synchronize()
    params = [p for p in trainer.draft.parameters() if p.requires_grad]
    trainer.step_fn.optimizer.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats, _ = trainer.step_fn.forward_backward(timed)
        if tracker is not None:
            tracker.log_record(record)
        clip_and_step(trainer.step_fn.optimizer, params, 1.0)  # the clip folded into the fused AdamW
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert float(stats.depth_count.sum()) > 0
    if tracker is not None:
        tracker.close()
        assert "train/memory_allocated_gib" in tracker_readers.tensorboard_scalars(tmp_path / "logs" / "tensorboard")


def _tensorboard_tracker(run_dir):
    """A real TensorBoard tracker into ``run_dir``; None where the extra is not installed."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return None
    options = TrackingOptions(logger="tensorboard")
    options.check_tracking()
    plan = plan_tracking(options, log_dir=run_dir / "logs", run_name="cuda", mlflow_default="file:unused")
    return open_tracker(plan, state_dir=run_dir, start=0, config={}, extras={}, say=lambda _: None)


def test_kill_and_resume_on_cuda_gives_the_same_losses(tiny_store, tmp_path, run_peagle):
    def args(run):
        return ["train", "--store", tiny_store.root, "--target", tiny_store.target_dir, "--out", run,
                "--num-layers", "1", "--num-depths", "3", "--max-steps", "6", "--token-budget", "256",
                "--draft-vocab-size", str(tiny_store.vocab_size), "--num-workers", "1", "--save-every", "2",
                "--log-every", "1", "--eval-every", "0", "--heldout-fraction", "0", "--warmup-steps", "1",
                "--seed", "3"]

    def losses(run):
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}

    straight = run_peagle(*args(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "attention flex (decoder layers compiled whole), compute bfloat16" in straight.stderr
    killed = run_peagle(*args(tmp_path / "killed"), env={"PEAGLE_FAILPOINT": "train.step:5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_peagle(*args(tmp_path / "killed"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step, loss in want.items():  # equal up to GPU float-summation order
        assert got[step] == pytest.approx(loss, rel=1e-3), step
