"""Sequence partitioning is exact (docs/mask.md): S in {2, 4} gives S = 1's loss and every gradient.

Random batches through the real collate (COD sampling, packing, segment plans) and the real trainer
step (``TrainStep.forward_backward``), on CPU in float32; then the same inside a 2-process gloo
DDP run, where the per-segment backwards run under ``no_sync`` except the last one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from peagle.model.draft import PEagleDraft
from peagle.pipeline.store_reader import training_sample
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.train_config import TrainConfig
from peagle.schemas.loader_config import CodSettings
from peagle.stages.train.batch import collate, make_item
from peagle.stages.train.loop import Trainer
from peagle.testing.trainer import trainer_for_draft
from peagle.testing.vllm_server import free_port
from peagle.stages.train.step import all_reduce_stats

TARGET_VOCAB, DRAFT_VOCAB, MASK_TOKEN, HIDDEN, NUM_AUX, TOPK, K = 96, 48, 95, 32, 3, 4, 5


def tiny_draft(num_layers: int = 2, seed: int = 0, **draft_kwargs) -> PEagleDraft:
    config = DraftConfig(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         num_layers=num_layers, target_hidden_size=HIDDEN, num_aux=NUM_AUX,
                         target_vocab_size=TARGET_VOCAB, draft_vocab_size=DRAFT_VOCAB, mask_token_id=MASK_TOKEN,
                         max_position_embeddings=512, aux_layer_ids=[1, 2, 3])
    torch.manual_seed(seed)
    draft = PEagleDraft(config, **{"train_lm_head": True, **draft_kwargs})  # every parameter gets a gradient
    draft.set_vocab_map(torch.arange(0, 2 * DRAFT_VOCAB, 2))
    return draft


def target_to_draft() -> torch.Tensor:
    t2d = torch.full((TARGET_VOCAB,), -1, dtype=torch.long)
    t2d[torch.arange(0, 2 * DRAFT_VOCAB, 2)] = torch.arange(DRAFT_VOCAB)
    return t2d


def random_items(seed: int, lengths: list[int]) -> list:
    g = torch.Generator().manual_seed(seed)
    items = []
    for j, n in enumerate(lengths):
        mask = torch.rand(n, generator=g) < 0.7
        logits = torch.randn(n, TARGET_VOCAB - 1, generator=g) * 2
        top = torch.log_softmax(logits, -1).topk(TOPK, dim=-1)
        sample = training_sample(f"s{seed}-{j}", torch.randint(0, TARGET_VOCAB - 1, (n,), generator=g), mask,
                                 torch.randn(n, NUM_AUX, HIDDEN, generator=g).to(torch.bfloat16),
                                 top.indices.to(torch.int32), top.values)
        items.append(make_item(sample, cod=CodSettings(num_depths=K, down_sample_ratio=0.7, down_sample_ratio_min=0.2),
                               seed=seed, epoch=0))
    return items


def batch_of(items, num_segments: int):
    return collate(items, target_to_draft_V=target_to_draft(), num_segments=num_segments)


def trainer_for(draft: PEagleDraft, num_segments: int) -> Trainer:
    config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", num_depths=K,
                                    sequence_partitions=num_segments, attention="sdpa", max_steps=1)
    return trainer_for_draft(config, draft)


def loss_and_grads(items_per_micro_batch: list[list], num_segments: int,
                   **draft_kwargs) -> tuple[float, dict[str, torch.Tensor]]:
    trainer = trainer_for(tiny_draft(**draft_kwargs), num_segments)
    stats, (count, _, _) = trainer.step_fn.forward_backward(
        [batch_of(items, num_segments) for items in items_per_micro_batch])
    grads = {name: p.grad.clone() for name, p in trainer.draft.named_parameters() if p.grad is not None}
    return float(stats.loss_sum) / count, grads


def assert_same(reference: tuple[float, dict], other: tuple[float, dict]) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segments_give_the_flat_loss_and_gradients(seed):
    # Packed samples of different lengths, two micro-batches: the count normalisation spans both.
    micro = [random_items(seed, [37, 9, 21]), random_items(seed + 100, [48])]
    reference = loss_and_grads(micro, 1)
    assert reference[0] > 0 and len(reference[1]) == len(list(tiny_draft().parameters()))
    for num_segments in (2, 4):
        assert_same(reference, loss_and_grads(micro, num_segments))


# ------------------------------------------------------------------------------------------------
# The same under 2-process gloo DDP


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    results = {}
    micro = [random_items(10 + rank, [33, 12]), random_items(20 + rank, [25])]
    for num_segments in (1, 2, 4):
        trainer = trainer_for(tiny_draft(), num_segments)
        stats, (count, _, _) = trainer.step_fn.forward_backward([batch_of(items, num_segments) for items in micro])
        results[num_segments] = (float(all_reduce_stats(stats).loss_sum) / count,
                                 {n: p.grad.clone() for n, p in trainer.draft.named_parameters()})
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "ddp.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_segments_are_exact_under_two_process_ddp(tmp_path):
    mp.start_processes(_ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    results = torch.load(tmp_path / "ddp.pt")
    for num_segments in (2, 4):
        assert_same(results[1], results[num_segments])
    # DDP with the global count equals one process holding both ranks' micro-batches.
    single = loss_and_grads([random_items(10, [33, 12]), random_items(20, [25]),
                             random_items(11, [33, 12]), random_items(21, [25])], 1)
    assert_same(single, results[1])
