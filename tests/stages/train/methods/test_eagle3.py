"""``--method eagle3``: its items, its step against sequential drafting written out, partitions, and a
whole run on the tiny store that resumes exactly.

The step test is the method's contract: through the real collate and the real trainer step, each
supervised element (anchor a, depth d) is charged the forward KL of the stored top-k against what
:func:`peagle.model.proposer.propose_sequential` (vLLM's eagle3 drafting) proposes as draft d + 1
on the prefix ending at a, fed the data's tokens: the unrolled training forward is that drafting.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from peagle.model.proposer import propose_sequential
from peagle.pipeline.store_reader import training_sample
from peagle.schemas.errors import UserError
from peagle.schemas.loader_config import CodSettings
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.batch import collate, make_item
from peagle.stages.train.cod import every_chain
from peagle.stages.train.loop import run_training
from peagle.stages.train.methods import EAGLE3
from peagle.testing.trainer import trainer_for_draft

sys.path.insert(0, str(Path(__file__).parent.parent))  # the train tests' helpers, whatever the import mode
from test_partition_equivalence import (HIDDEN, NUM_AUX, TARGET_VOCAB, TOPK, assert_same, target_to_draft,  # noqa: E402
                                        tiny_draft)

K = 4


def eagle3_draft(seed: int = 0):
    draft = tiny_draft(seed=seed)
    config = dataclasses.replace(draft.config, method="eagle3", mask_token_id=None)
    torch.manual_seed(seed)
    out = type(draft)(config, train_lm_head=True)
    out.set_vocab_map(torch.arange(0, 2 * config.draft_vocab_size, 2))
    return out


def random_samples(seed: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for j, n in enumerate(lengths):
        logits = torch.randn(n, TARGET_VOCAB - 1, generator=g) * 2
        top = torch.log_softmax(logits, -1).topk(TOPK, dim=-1)
        samples.append(training_sample(f"e{seed}-{j}", torch.randint(0, TARGET_VOCAB - 1, (n,), generator=g),
                                       torch.rand(n, generator=g) < 0.8, torch.randn(n, NUM_AUX, HIDDEN, generator=g),
                                       top.indices.to(torch.int32), top.values))
    return samples


def items_of(samples, seed: int = 0, epoch: int = 0):
    return [make_item(s, cod=CodSettings(num_depths=K), seed=seed, epoch=epoch, method=EAGLE3) for s in samples]


def trainer_for(draft, num_segments: int = 1):
    config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", method="eagle3", num_depths=K,
                                    sequence_partitions=num_segments, attention="sdpa", max_steps=1)
    return trainer_for_draft(config, draft)


def test_an_item_holds_every_chain_whatever_the_seed():
    (sample,) = random_samples(0, [30])
    items = items_of([sample], 0, 0) + items_of([sample], 5, 3)
    want = every_chain(sample.num_positions, sample.supervised_T, K)
    for item in items:
        assert torch.equal(item.anchor_pos, want[0]) and torch.equal(item.depth, want[1])
    m = sample.supervised_T
    for a, d in zip(*want):  # depth d >= 1: its d drafts' positions are supervised
        assert d == 0 or bool(m[int(a) + 1:int(a) + int(d) + 1].all())


def test_a_unit_plans_one_block_mask_per_depth():
    batch = collate(items_of(random_samples(1, [20, 12])), target_to_draft_V=target_to_draft(), block_size=8,
                    method=EAGLE3)
    (unit,) = batch.units
    starts = unit.depth_starts
    assert starts[0] == 0 and starts[-1] == batch.num_elements and starts[1] == unit.num_real == batch.num_tokens
    assert len(unit.block_indices) == sum(b > a for a, b in zip(starts, starts[1:])) == K
    for (start, stop), indices in zip(zip(starts, starts[1:]), unit.block_indices):
        assert indices.seq_len == stop - start and (indices.kv_seq_len or indices.seq_len) == stop


@pytest.mark.parametrize("seed", [0, 1])
def test_the_step_charges_each_element_the_kl_of_sequential_drafting(seed):
    samples = random_samples(seed, [17, 9, 23])
    batch = collate(items_of(samples), target_to_draft_V=target_to_draft(), method=EAGLE3)
    draft = eagle3_draft(seed)
    stats, (count, _, _) = trainer_for(draft).step_fn.forward_backward([batch])

    starts = batch.doc_starts_D.tolist()
    want, correct = torch.zeros(K, dtype=torch.float64), torch.zeros(K)
    for e, i in enumerate(batch.supervised_idx_E.tolist()):
        a, d = int(batch.anchor_N[i]), int(batch.depth_N[i])
        doc = max(j for j, s in enumerate(starts) if s <= a)
        sample, local = samples[doc], a - starts[doc]
        tokens = sample.input_ids_n
        forced = iter(tokens[local + 2:].tolist() + [0] * K)
        proposal = propose_sequential(draft, tokens[:local + 2], sample.aux_TAH[:local + 1].float(), d + 1,
                                      choose=lambda logits_V: torch.tensor(next(forced)))
        logp_V = torch.log_softmax(proposal.logits_KV[d].double(), -1)
        ids, p = batch.target_ids_Ek[e], batch.target_probs_Ek[e].double()
        keep = ids >= 0
        want[d] += float((torch.xlogy(p[keep], p[keep]) - p[keep] * logp_V[ids[keep]]).sum())
        correct[d] += float(int(logp_V.argmax()) == int(ids[0]))
    assert count == batch.num_supervised
    torch.testing.assert_close(stats.depth_loss_sum.double(), want, rtol=1e-4, atol=1e-4)
    assert stats.depth_correct.tolist() == correct.tolist()


def test_partitions_are_exact_for_the_unrolled_steps():
    items = items_of(random_samples(3, [40, 25]))

    def loss_and_grads(num_segments: int):
        trainer = trainer_for(eagle3_draft(3), num_segments)
        batch = collate(items, target_to_draft_V=target_to_draft(), num_segments=num_segments, method=EAGLE3)
        stats, (count, _, _) = trainer.step_fn.forward_backward([batch])
        return float(stats.loss_sum) / count, {n: p.grad.clone() for n, p in trainer.draft.named_parameters()
                                                 if p.grad is not None}

    assert_same(loss_and_grads(1), loss_and_grads(3))


def test_peagle_only_settings_and_fsdp_are_refused_in_one_line():
    base = dict(store=("s",), target="t", out="o", method="eagle3")
    with pytest.raises(UserError, match=r"--down-sample-ratio, --max-anchors are P-EAGLE's"):
        TrainConfig.from_flags(**base, down_sample_ratio=0.5, max_anchors=4)
    with pytest.raises(UserError, match="--fsdp is not offered with --method eagle3"):
        TrainConfig.from_flags(**base, fsdp=True, optimizer="adamw")
    with pytest.raises(UserError, match="--method must be one of peagle|eagle3"):
        TrainConfig.from_flags(store=("s",), target="t", out="o", method="medusa")


# ------------------------------------------------------------------------------------------------
# A whole run on the tiny store


def run_config(tiny, out, **kw) -> TrainConfig:
    base = dict(store=(str(tiny.root),), target=str(tiny.target_dir), out=str(out), method="eagle3", num_layers=1,
                num_depths=3, token_budget=256, draft_vocab_size=tiny.vocab_size, max_steps=4, lr=2e-3,
                warmup_steps=1, log_every=1, save_every=2, eval_every=2, heldout_fraction=0.25, num_workers=1)
    return TrainConfig.from_flags(**{**base, **kw})


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_checkpoints_an_eagle3_draft_and_resumes_exactly(tiny_store, tmp_path):
    straight = tmp_path / "straight"
    run_training(run_config(tiny_store, straight))
    train = [r for r in metrics(straight) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and train[-1]["loss"] < train[0]["loss"]
    assert all(len(r["depth_count"]) == 3 and r["num_chains"] > 0 for r in train)
    config = torch.load(straight / "checkpoints" / "step-00000004" / "config.pt")
    assert config["draft_config"]["method"] == "eagle3" and config["draft_config"]["mask_token_id"] is None
    weights = torch.load(straight / "checkpoints" / "step-00000004" / "model.pt")
    assert "mask_hidden" not in weights

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")  # as if killed after the step-2 checkpoint
    run_training(run_config(tiny_store, resumed))
    timing = ("tokens_per_s", "data_wait_share", "step_time_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in metrics(resumed)] == \
           [{k: v for k, v in r.items() if k not in timing} for r in metrics(straight)]
    again = torch.load(resumed / "checkpoints" / "step-00000004" / "model.pt")
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    with pytest.raises(UserError, match="--method was 'eagle3' in the checkpointed run and is 'peagle' now"):
        run_training(run_config(tiny_store, resumed, method="peagle", max_steps=5))
