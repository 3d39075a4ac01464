"""The CUDA path of training (``pytest -m cuda``; skipped without a CUDA device).

On a GPU these check what the CPU suite cannot: compiled flex attention's loss and gradients
against SDPA (bf16 autocast, fp32 master weights), the BlockMask built from the loader workers'
indices against ``create_block_mask`` on the device, that a step issues no host sync before the
clip (``torch.cuda.set_sync_debug_mode("error")``), and kill -9 + resume through the real CLI.
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
from peagle.stages.train.loop import Trainer

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


def _trainer(tiny_store, attention: str, partitions: int = 1) -> Trainer:
    hf_config = AutoConfig.from_pretrained(tiny_store.target_dir)
    draft_config = DraftConfig.from_target_config(hf_config, num_layers=2, mask_token_id=tiny_store.mask_token_id)
    torch.manual_seed(0)
    draft = build_draft_from_target(tiny_store.target_dir, draft_config, train_lm_head=True)
    config = TrainConfig(store=(str(tiny_store.root),), target=str(tiny_store.target_dir), out="unused",
                         num_depths=4, sequence_partitions=partitions, attention=attention, max_steps=10,
                         lr=1e-3, warmup_steps=0)
    trainer = Trainer.for_model(config, draft)
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
        if attention == "flex":
            assert trainer.step_fn.flex.compiled and trainer.step_fn.flex.compile_error is None
    (flex_loss, flex_grads), (sdpa_loss, sdpa_grads) = results["flex"], results["sdpa"]
    assert flex_loss == pytest.approx(sdpa_loss, rel=1e-2)
    assert flex_grads.keys() == sdpa_grads.keys() and len(flex_grads) == len(list(trainer.draft.parameters()))
    for name, want in sdpa_grads.items():  # bf16 attention in both, different kernels: relative error
        error = float((flex_grads[name] - want).norm() / want.norm().clamp_min(1e-12))
        assert error < 3e-2, f"{name}: relative gradient difference {error:.3g}"


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


def test_a_step_does_not_sync_with_the_host_before_the_clip(tiny_store):
    trainer = _trainer(tiny_store, "flex")
    warmup, timed = _batches(tiny_store, 2), _batches(tiny_store, 1, epoch=1)
    for batch in warmup:  # compiling (and autotuning) may sync; the steady state may not
        trainer.train_step([batch])
    torch.cuda.synchronize()
    params = [p for p in trainer.draft.parameters() if p.requires_grad]
    trainer.step_fn.optimizer.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats, _ = trainer.step_fn.forward_backward(timed)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert float(stats.depth_count.sum()) > 0


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
    assert "attention flex (torch.compile'd), compute bfloat16" in straight.stderr
    killed = run_peagle(*args(tmp_path / "killed"), env={"PEAGLE_FAILPOINT": "train.step:5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_peagle(*args(tmp_path / "killed"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step, loss in want.items():  # equal up to GPU float-summation order
        assert got[step] == pytest.approx(loss, rel=1e-3), step
