"""torchrun --nproc-per-node 2 on CPU (gloo) trains exactly like one process with the same global batch,
with DDP (AdamW and Muon) and with FSDP2 (whose checkpoint also resumes exactly); FSDP2 with the bf16 mixed-precision
policy (what CUDA runs use) gathers bf16 parameters, keeps fp32 master weights and gradients, and
trains like one process under bf16 autocast, within bf16 tolerance.

This file is also the torchrun script: ``python -m torch.distributed.run --nproc-per-node 2 test_ddp.py
OUT`` runs ``_worker`` on each rank (rank r takes micro-batch r of every step); the test runs it and
one process that takes both micro-batches of every step (grad_accum 2), and compares the per-step
losses and the final weights. A real ``peagle train`` under torchrun is checked too: it runs, its
checkpoint records two ranks (each with its own RNG state), and a resume with another world size is refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle.pipeline import checkpoint_files as cf
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train import checkpoint as ckpt
from peagle.stages.train.loop import Trainer
from peagle.testing.trainer import trainer_for_draft

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # sibling test helpers, also when run as a torchrun script
from test_partition_equivalence import batch_of, random_items, tiny_draft  # noqa: E402

NUM_STEPS = 3


def _failure(proc: subprocess.CompletedProcess) -> str:
    """The ranks' own error lines first (torchrun's summary at the end says little)."""
    lines = (proc.stdout + proc.stderr).splitlines()
    own = [line for line in lines if ("rank" in line and "]:" in line) or line.lstrip().startswith("File ")
           or any(word in line for word in ("terminate", "Error", "error:", "abort", "Abort", "Thread 0x"))]
    return "\n".join(own[-60:] + lines[-15:])


def _micro_batches(step: int, rank: int):
    """Micro-batch ``rank`` of ``step``: a few packed random samples (deterministic)."""
    lengths = [[31, 14], [40], [9, 22, 17], [36]][(step + rank) % 4]
    return batch_of(random_items(1000 * step + rank, lengths), 2)


def _trainer(world_size: int, *, fsdp: bool = False, compute_dtype: torch.dtype | None = None,
             optimizer: str = "adamw") -> Trainer:
    config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", num_depths=5,
                                    sequence_partitions=2, attention="sdpa", max_steps=NUM_STEPS + 1,
                                    grad_accum=2 // world_size, lr=3e-3, warmup_steps=1, fsdp=fsdp, optimizer=optimizer)
    return trainer_for_draft(config, tiny_draft(num_layers=2), compute_dtype=compute_dtype)


def _steps(trainer, world_size: int, rank: int, steps: range, chains: list | None = None) -> list[float]:
    """Per-step losses; ``chains`` collects each step's (num_chains, acceptance_length_estimate)."""
    losses = []
    for step in steps:
        micro = [_micro_batches(step, r) for r in range(2)] if world_size == 1 else [_micro_batches(step, rank)]
        trainer.train_step(micro)
        record = trainer.window_metrics(1.0)
        losses.append(record["loss"])
        if chains is not None:
            chains.append((record["num_chains"], record["acceptance_length_estimate"]))
    return losses


def _weights(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(trainer.draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _run(world_size: int, rank: int, compute_dtype: torch.dtype | None = None, optimizer: str = "adamw"):
    trainer = _trainer(world_size, compute_dtype=compute_dtype, optimizer=optimizer)
    chains = []
    losses = _steps(trainer, world_size, rank, range(NUM_STEPS), chains)
    return losses, {k: v.detach().clone() for k, v in _weights(trainer).items()}, chains


def _worker(out: str) -> None:
    """DDP steps; FSDP2 steps; an FSDP2 checkpoint written, loaded into a fresh trainer, trained on."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    ddp_losses, ddp_weights, ddp_chains = _run(2, rank)
    muon_losses, muon_weights, _ = _run(2, rank, optimizer="muon")  # Muon sees the all-reduced gradient
    fsdp = _trainer(2, fsdp=True)
    fsdp_losses = _steps(fsdp, 2, rank, range(NUM_STEPS))
    fsdp_weights = _weights(fsdp)
    path = ckpt.Checkpointer(Path(out).parent / "fsdp_run", keep=1).save(NUM_STEPS, fsdp.state_dict())
    fresh = _trainer(2, fsdp=True)
    fresh.load_state_dict(ckpt.load_checkpoint(cf.latest_valid_checkpoint(Path(out).parent / "fsdp_run")))
    resumed_weights = _weights(fresh)
    next_losses = [_steps(t, 2, rank, range(NUM_STEPS, NUM_STEPS + 1))[0] for t in (fsdp, fresh)]
    # Mixed precision: the dtypes a layer computes with, the master shards' and gradients' dtypes.
    mixed = _trainer(2, fsdp=True, compute_dtype=torch.bfloat16)
    gathered = []
    mixed.draft.layers[1].register_forward_pre_hook(
        lambda layer, args: gathered.append({p.dtype for p in layer.parameters()}))
    mixed_losses = _steps(mixed, 2, rank, range(NUM_STEPS))
    mixed_dtypes = {"gathered": gathered, "master": {p.dtype for p in mixed.draft.parameters()},
                    "grads": {p.grad.dtype for p in mixed.draft.parameters() if p.grad is not None}}
    mixed_weights = _weights(mixed)
    if rank == 0:
        assert path is not None
        torch.save({"losses": ddp_losses, "weights": ddp_weights, "chains": ddp_chains, "fsdp_losses": fsdp_losses,
                    "fsdp_weights": fsdp_weights, "resumed_weights": resumed_weights, "next_losses": next_losses,
                    "mixed_losses": mixed_losses, "mixed_dtypes": mixed_dtypes, "mixed_weights": mixed_weights,
                    "muon_losses": muon_losses, "muon_weights": muon_weights},
                   out)
    del fsdp, mixed  # their FSDP modules hold the process group: freed before it is destroyed
    fresh.close(finished=True)


def test_torchrun_two_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    out = tmp_path / "ddp.pt"
    # PYTHONFAULTHANDLER: a rank killed by a native abort prints every thread's Python stack.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(HERE), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, _failure(proc)
    ddp = torch.load(out)
    losses, weights, chains = _run(1, 0)
    assert ddp["losses"] == pytest.approx(losses, rel=1e-5)
    assert len(set(losses)) == NUM_STEPS  # the steps did train
    # The chain sums are sums over ranks too: the same chains, the same acceptance length.
    assert [n for n, _ in ddp["chains"]] == [n for n, _ in chains] and all(n > 0 for n, _ in chains)
    assert [al for _, al in ddp["chains"]] == pytest.approx([al for _, al in chains], rel=1e-9)
    for name, value in weights.items():
        torch.testing.assert_close(ddp["weights"][name], value, rtol=1e-4, atol=1e-6, msg=name)
    # --optimizer muon: every rank orthogonalises the same all-reduced gradient, as one process does.
    muon_losses, muon_weights, _ = _run(1, 0, optimizer="muon")
    assert ddp["muon_losses"] == pytest.approx(muon_losses, rel=1e-5) and muon_losses != pytest.approx(losses)
    for name, value in muon_weights.items():
        torch.testing.assert_close(ddp["muon_weights"][name], value, rtol=1e-4, atol=1e-6, msg=name)
    # FSDP2 (--fsdp) trains the same, and its checkpoint (full tensors, unwrapped keys) resumes exactly.
    assert ddp["fsdp_losses"] == pytest.approx(losses, rel=1e-5)
    assert ddp["fsdp_weights"].keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(ddp["fsdp_weights"][name], value, rtol=1e-4, atol=1e-6, msg=name)
        assert torch.equal(ddp["resumed_weights"][name], ddp["fsdp_weights"][name]), name
    assert ddp["next_losses"][0] == ddp["next_losses"][1]
    # FSDP2 with the bf16 policy: bf16 all-gathers, fp32 master weights and reduced gradients, and the
    # training of one process under bf16 autocast (weights cast per op instead), to bf16 tolerance.
    dtypes = ddp["mixed_dtypes"]
    assert dtypes["gathered"] and all(d == {torch.bfloat16} for d in dtypes["gathered"])
    assert dtypes["master"] == {torch.float32} and dtypes["grads"] == {torch.float32}
    bf16_losses, bf16_weights, _ = _run(1, 0, compute_dtype=torch.bfloat16)
    assert ddp["mixed_losses"] == pytest.approx(bf16_losses, rel=2e-2)
    assert ddp["mixed_losses"] != pytest.approx(losses, rel=1e-5)  # bf16 did change the arithmetic
    initial = tiny_draft(num_layers=2).state_dict()
    floats = {n: v for n, v in bf16_weights.items() if v.is_floating_point()}
    for name, value in floats.items():  # the 3 steps' updates agree to bf16 noise (a few %)
        update, mixed_update = value - initial[name], ddp["mixed_weights"][name] - initial[name]
        assert float(update.norm()) > 0 and float((mixed_update - update).norm() / update.norm()) < 0.25, name


@pytest.mark.slow
def test_peagle_train_under_torchrun(tmp_path, tiny_store):
    """The real CLI on two gloo ranks: metrics and an evaluation, a checkpoint of both ranks' data state, one-line refusal."""
    from peagle.stages.train.vocab import build_draft_vocab

    build_draft_vocab(tiny_store.root, 128)
    run = tmp_path / "run"

    def args(max_steps: int) -> list[str]:
        return ["train", "--store", str(tiny_store.root), "--target", str(tiny_store.target_dir), "--out", str(run),
                "--max-steps", str(max_steps), "--num-layers", "1", "--token-budget", "128",
                "--draft-vocab-size", "128", "--num-workers", "0", "--log-every", "1", "--num-depths", "3",
                "--heldout-fraction", "0.25", "--eval-every", "2"]

    # PYTHONFAULTHANDLER: a rank killed by a native abort prints every thread's Python stack.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", "-m", "peagle", *args(2)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, _failure(proc)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("kind")) for r in records] == [(1, "train"), (2, "train"), (2, "eval")]  # rank 0 alone writes
    eval_line = records[-1]  # both ranks' held-out batches, their stats and no-target counts summed
    assert eval_line["num_chains"] > 0 and isinstance(eval_line["num_no_target"], int)
    data = torch.load(run / "checkpoints" / "step-00000002" / "dataloader.pt")
    assert data["world_size"] == 2 and {"rank_0", "rank_1"} <= set(data)
    rng = torch.load(run / "checkpoints" / "step-00000002" / "rng.pt")  # each rank draws its own (--aux-noise)
    assert not torch.equal(rng["rank_0"]["torch"], rng["rank_1"]["torch"])

    proc = subprocess.run([sys.executable, "-m", "peagle", *args(3)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("peagle: error:"), proc.stderr[-2000:]
    assert "2 processes" in proc.stderr and "Traceback" not in proc.stderr


if __name__ == "__main__":
    _worker(sys.argv[1])
