"""The shard loader: partitions, determinism, resume, mixing, held-out split, store checks."""

from __future__ import annotations

import dataclasses

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from peagle.pipeline.split import is_heldout
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import StoreSpec
from peagle.stages.train.epoch_plan import plan_epoch, worker_batches
from peagle.schemas.loader_config import CodSettings, LoaderConfig
from peagle.stages.train.loader import TrainLoader, build_sample_index, plan_settings
from peagle.stages.train.training_stores import open_training_stores

COD = CodSettings(num_depths=4)
BUDGET = 400  # training positions per batch: 2-3 tiny chat samples


def config(*stores, **kw) -> LoaderConfig:
    specs = tuple(s if isinstance(s, StoreSpec) else StoreSpec(str(s.root)) for s in stores)
    return LoaderConfig(stores=specs, **{"token_budget": BUDGET, "cod": COD, **kw})


def batch_refs(plan, rank: int, batch: int) -> np.ndarray:
    """The sample refs of one planned batch of one rank."""
    bounds = plan.bounds_of_rank[rank]
    return plan.refs_of_rank[rank][bounds[batch]:bounds[batch + 1]]


def fingerprint(batch) -> tuple:
    """Everything that makes a batch what it is, cheap to compare."""
    return (batch.epoch, batch.batch_index, batch.sample_ids, batch.anchor_N.tolist(), batch.depth_N.tolist(),
            batch.supervised_idx_E.tolist(), batch.target_ids_Ek.sum().item(),
            round(batch.target_probs_Ek.double().sum().item(), 6), float(batch.aux_TAH.float().sum()))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_plan_partitions_are_disjoint_covering_and_balanced(tiny_store, world_size):
    cfg = config(tiny_store)
    stores = open_training_stores(cfg)
    index = build_sample_index(stores, cfg)
    for epoch in (0, 1):
        plan = plan_epoch(index, plan_settings(cfg), epoch, world_size)
        kept = []
        for rank in range(world_size):
            bounds = plan.bounds_of_rank[rank]
            assert len(bounds) - 1 >= plan.num_batches
            positions = index.positions_of[plan.refs_of_rank[rank]]
            for b in range(len(bounds) - 1):
                assert positions[bounds[b]:bounds[b + 1]].sum() <= BUDGET
            for num_workers in (0, 1, 2, 3):
                by_worker = [list(worker_batches(plan.num_batches, 0, w, num_workers))
                             for w in range(max(1, num_workers))]
                flat = sorted(b for bs in by_worker for b in bs)
                assert flat == list(range(plan.num_batches))  # workers: disjoint and covering
            kept += [int(r) for b in range(plan.num_batches) for r in batch_refs(plan, rank, b)]
        everything = [int(r) for refs in plan.refs_of_rank for r in refs]
        assert len(everything) == len(set(everything)) == int(index.eligible.sum())  # ranks: disjoint, covering
        assert len(kept) == len(set(kept)) == len(everything) - plan.num_dropped_samples
        tokens = [int(index.positions_of[refs].sum()) for refs in plan.refs_of_rank]
        biggest_shard = max(int(index.positions_of[index.shard_of == j].sum()) for j in range(len(stores[0].shards)))
        assert max(tokens) - min(tokens) <= biggest_shard


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_equal_batch_counts_and_disjoint_samples(tiny_store, world_size):
    loaders = [TrainLoader(config(tiny_store), rank=r, world_size=world_size) for r in range(world_size)]
    num_batches = loaders[0].num_batches  # epoch 0's; after the epoch it is epoch 1's, which may differ
    streams = [[b.sample_ids for b in loader] for loader in loaders]
    assert len({len(s) for s in streams}) == 1 and len(streams[0]) == num_batches > 0
    seen = [sid for s in streams for ids in s for sid in ids]
    assert len(seen) == len(set(seen))


def test_stream_matches_the_raw_store(tiny_store):
    loader = TrainLoader(config(tiny_store))
    seen = []
    for batch in loader:
        for start, length, sid in zip(batch.doc_starts_D.tolist(), batch.doc_lengths_D.tolist(), batch.sample_ids):
            raw = tiny_store.samples[sid]
            seen.append(sid)
            assert length == len(raw.input_ids) - 1
            assert batch.tokens_T[start:start + length].tolist() == raw.input_ids[1:]
            assert torch.equal(batch.aux_TAH[start:start + length], raw.aux_nAH[:-1])
            assert batch.supervised_T[start:start + length].tolist() == [bool(m) for m in raw.loss_mask[2:]] + [False]
            ref_N = batch.anchor_N + batch.depth_N
            in_doc = (batch.anchor_N[batch.supervised_idx_E] >= start) & (batch.anchor_N[batch.supervised_idx_E]
                                                                          < start + length)
            for e in torch.nonzero(in_doc).flatten().tolist():
                ref = int(ref_N[batch.supervised_idx_E[e]]) - start
                assert raw.loss_mask[ref + 2] == 1
                assert batch.target_ids_Ek[e].tolist() == raw.topk_ids_nk[ref + 1].tolist()
                probs = raw.topk_logprobs_nk[ref + 1].float().exp()
                torch.testing.assert_close(batch.target_probs_Ek[e], probs / probs.sum())
    assert sorted(seen) == sorted(tiny_store.order)  # world size 1: the whole store, once


def test_same_seed_same_stream_other_epoch_or_seed_other_order(tiny_store):
    def stream(seed, epochs=2):
        loader = TrainLoader(config(tiny_store, seed=seed))
        return [[fingerprint(b) for b in loader] for _ in range(epochs)]

    a, b = stream(0), stream(0)
    assert a == b
    epoch0_ids = [f[2] for f in a[0]]
    epoch1_ids = [f[2] for f in a[1]]
    assert epoch0_ids != epoch1_ids
    assert sorted(sum(map(list, epoch0_ids), [])) == sorted(sum(map(list, epoch1_ids), []))
    assert [f[2] for f in stream(1, epochs=1)[0]] != epoch0_ids


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_stream_does_not_depend_on_num_workers_and_resumes_exactly(tiny_store, num_workers):
    cfg = config(tiny_store, num_workers=0, attention="flex", block_size=32)
    reference_loader = TrainLoader(cfg, rank=1, world_size=2)
    per_epoch = reference_loader.num_batches
    stream = reference_loader.stream()
    reference = [fingerprint(next(stream)) for _ in range(per_epoch + 2)]  # into the second epoch

    worker_cfg = config(tiny_store, num_workers=num_workers, attention="flex", block_size=32)
    for cut in (0, 1, per_epoch - 1, per_epoch + 1):
        first = TrainLoader(worker_cfg, rank=1, world_size=2)
        it = first.stream()
        head = [fingerprint(next(it)) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
        resumed = TrainLoader(config(tiny_store, num_workers=(num_workers + 1) % 4, attention="flex",
                                     block_size=32), rank=1, world_size=2)
        resumed.load_state_dict(state)
        it = resumed.stream()
        tail = [fingerprint(next(it)) for _ in range(per_epoch + 2 - cut)]
        assert head + tail == reference, f"cut at {cut}"


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("followed", [False, True])
def test_the_next_epochs_workers_start_when_this_epochs_have_built_their_last_batch(tiny_store, followed):
    """Without a source the next epoch's DataLoader starts while the last ``batches_in_flight`` batches of
    this one are handed out (its workers are idle then); a followed store decides an epoch's shards when
    it begins, so its next epoch starts at the boundary. The stream is the same either way (above)."""
    from peagle.stages.train import follow

    source = follow.FollowSource([tiny_store.root], timeout_s=30, say=lambda _: None) if followed else None
    loader = TrainLoader(config(tiny_store, num_workers=2, prefetch_factor=1), source=source)
    n, ahead = loader.num_batches, loader.batches_in_flight
    assert ahead == 2 and n > ahead + 1
    started, handing_out = [], 0  # (epoch, the stream's batch being fetched when it started)
    real_batches = loader.batches

    def spy(epoch: int, start: int = 0):
        started.append((epoch, handing_out))
        return real_batches(epoch, start)

    loader.batches = spy
    stream = loader.stream()
    for handing_out in range(2 * n + 1):
        next(stream)
    at = n if followed else n - 1 - ahead  # the batch of epoch 0 whose fetch started epoch 1
    assert started == [(0, 0), (1, at), (2, n + at)]


def test_state_counts_handed_out_batches_and_rolls_over_epochs(tiny_store):
    loader = TrainLoader(config(tiny_store))
    assert (loader.state_dict()["epoch"], loader.state_dict()["batch_in_epoch"]) == (0, 0)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["batch_in_epoch"] == 1
    for _ in it:
        pass
    assert (loader.state_dict()["epoch"], loader.state_dict()["batch_in_epoch"]) == (1, 0)


@pytest.mark.parametrize("change, message", [
    (dict(seed=5), "seed=0"),
    (dict(token_budget=300), "token_budget=400"),
    (dict(cod=CodSettings(num_depths=3)), "cod.num_depths=4"),
])
def test_resume_refuses_another_stream_in_one_line(tiny_store, change, message):
    state = TrainLoader(config(tiny_store)).state_dict()
    with pytest.raises(UserError) as err:
        TrainLoader(config(tiny_store, **change)).load_state_dict(state)
    assert "\n" not in str(err.value) and message in str(err.value)
    with pytest.raises(UserError) as err:
        TrainLoader(config(tiny_store), rank=0, world_size=2).load_state_dict(state)
    assert "\n" not in str(err.value) and "world_size=1" in str(err.value) and "world_size=2" in str(err.value)


def test_a_checkpoint_older_than_a_cod_knob_resumes_at_its_default_and_not_off_it(tiny_store):
    """A COD knob added after a checkpoint was written is absent from its loader state: that run had
    the knob's default, so a resume at the default goes on and one at another value is refused."""
    cod = CodSettings()
    state = TrainLoader(config(tiny_store, cod=cod)).state_dict()
    newest = sorted(k for k in state["identity"] if k.startswith("cod."))[-1]
    del state["identity"][newest]
    TrainLoader(config(tiny_store, cod=cod)).load_state_dict(state)
    field = newest.removeprefix("cod.")
    other = dataclasses.replace(cod, **{field: getattr(cod, field) + 1})
    with pytest.raises(UserError, match=newest):
        TrainLoader(config(tiny_store, cod=other)).load_state_dict(state)


def test_mixing_follows_the_weights(tiny_store, tiny_store_b):
    a, b = StoreSpec(str(tiny_store.root), 1.0), StoreSpec(str(tiny_store_b.root), 1.0)
    total = len(tiny_store.order) + len(tiny_store_b.order)
    loader = TrainLoader(config(a, b, token_budget=100_000))  # one store's weight share each: b is repeated
    ids = [sid for batch in loader for sid in batch.sample_ids]
    from_b = [sid for sid in ids if sid in tiny_store_b.samples]
    assert abs(len(ids) - total) <= 1 and abs(len(from_b) - total / 2) <= 1
    assert set(from_b) == set(tiny_store_b.order)  # every b sample, in repeated passes
    assert max(Counter(from_b).values()) == -(-len(from_b) // len(tiny_store_b.order))
    positions = [i for i, sid in enumerate(ids) if sid in tiny_store_b.samples]
    assert max(np.diff(positions)) <= 3  # interleaved evenly, not appended
    mixed = TrainLoader(config(a, b))
    batch = next(iter(mixed))
    assert batch.target_probs_Ek.dtype == torch.float32  # float16 and float32 stores mix


def test_heldout_split_is_stable_and_disjoint(tiny_store):
    fraction = 0.3
    held = {sid for sid in tiny_store.order if is_heldout(sid, fraction)}
    assert 0 < len(held) < len(tiny_store.order)
    assert not is_heldout(tiny_store.order[0], 0.0)
    heldout = TrainLoader(config(tiny_store, split="heldout", heldout_fraction=fraction, shuffle=False))
    train = TrainLoader(config(tiny_store, split="train", heldout_fraction=fraction))
    got_held = {sid for b in heldout for sid in b.sample_ids}
    got_train = {sid for b in train for sid in b.sample_ids}
    assert got_held == held and got_train == set(tiny_store.order) - held


def test_long_samples_are_skipped_and_batches_fit_the_budget(tiny_store):
    budget = 120
    loader = TrainLoader(config(tiny_store, token_budget=budget))
    too_long = sum(len(s.input_ids) - 1 > budget for s in tiny_store.samples.values())
    assert loader.index.num_too_long == too_long > 0
    for batch in loader:
        assert batch.num_tokens <= budget


def test_other_aux_layers_are_a_one_line_error(tiny_store):
    with pytest.raises(UserError) as err:
        TrainLoader(config(tiny_store, aux_layer_ids=(1, 4, 5)))
    assert "\n" not in str(err.value) and "aux_layer_ids 2,4,5, training asks for aux_layer_ids 1,4,5" in str(err.value)


def test_mixed_stores_must_agree_and_verify_checks_sha256(tiny_store, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_store.root, other)
    settings = json.loads((other / "store.json").read_text())
    settings["topk"] = 4
    (other / "store.json").write_text(json.dumps(settings))
    with pytest.raises(UserError) as err:
        TrainLoader(config(tiny_store, StoreSpec(str(other))))
    assert "\n" not in str(err.value) and "topk 4" in str(err.value) and "8" in str(err.value)

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_store.root, damaged)
    shard = damaged / "shards" / "00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    TrainLoader(config(StoreSpec(str(damaged))))  # sizes still match: the fast path opens it
    with pytest.raises(UserError) as err:
        TrainLoader(config(StoreSpec(str(damaged)), verify=True))
    assert "\n" not in str(err.value) and "sha256" in str(err.value)


def test_workers_leave_aux_rows_on_disk_until_the_trainer_reads_them(tiny_store):
    from peagle.pipeline.store_reader import ShardReader
    from peagle.stages.train.loader import ShardStream

    loader = TrainLoader(config(tiny_store))
    plan = loader.plan(0)
    refs = plan.refs_of_rank[0]
    loc = np.stack([loader.index.store_of[refs], loader.index.shard_of[refs], loader.index.row_of[refs]])
    stream = ShardStream(loader.stores, loader.config, loc_3B=loc, bounds=plan.bounds_of_rank[0],
                         num_batches=plan.num_batches, start=0, epoch=0,
                         target_to_draft_V=loader.target_to_draft_V)
    lazy = stream.build(ShardReader(loader.stores, capacity=2), 0)
    assert lazy.aux_TAH is None and len(lazy.aux_source.reads) == lazy.num_samples
    expected = torch.cat([tiny_store.samples[sid].aux_nAH[:-1] for sid in lazy.sample_ids])
    assert torch.equal(lazy.materialize().aux_TAH, expected)
    assert torch.equal(lazy.to("cpu").aux_TAH, expected) and lazy.to("cpu").aux_source is None
    assert torch.equal(next(iter(loader)).aux_TAH, expected)  # the loader hands out read batches


# ------------------------------------------------------------------------------------------------
# FP8 stores: the same stream, half the aux bytes to the device, dequantised there or in the workers


@pytest.fixture(scope="module")
def fp8_store(tiny_store, tmp_path_factory):
    """``tiny_store`` converted to fp8 (peagle store convert)."""
    from peagle.stages.store.convert import convert_store

    out = tmp_path_factory.mktemp("fp8") / "store"
    convert_store(tiny_store.root, out, "fp8", echo=lambda _: None, progress=False)
    return out


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_fp8_stream_is_the_bf16_stream_with_dequantised_rows(tiny_store, fp8_store, num_workers):
    from peagle.pipeline import fp8

    bf16_batches = list(TrainLoader(config(tiny_store)))
    fp8_batches = list(TrainLoader(config(StoreSpec(str(fp8_store)), num_workers=num_workers)))
    assert len(bf16_batches) == len(fp8_batches)
    for a, b in zip(bf16_batches, fp8_batches):
        assert fingerprint(a)[:-1] == fingerprint(b)[:-1]  # everything but the aux rows
        assert b.aux_TAH.dtype == torch.bfloat16 and b.aux_scale_TA is None  # dequantised in the workers
        assert torch.equal(b.aux_TAH, fp8.dequantize(*fp8.quantize(a.aux_TAH)))


def test_fp8_batches_ship_codes_and_scales_for_the_device(fp8_store, tiny_store):
    """``dequantize_in_workers=False`` (GPU training): the pin thread reads fp8 codes and their scales,
    about half the bytes of the bf16 rows, and ``aux_states`` dequantises wherever the batch is."""
    device_path = next(iter(TrainLoader(config(StoreSpec(str(fp8_store)), dequantize_in_workers=False))))
    worker_path = next(iter(TrainLoader(config(StoreSpec(str(fp8_store))))))
    bf16 = next(iter(TrainLoader(config(tiny_store))))
    assert device_path.aux_TAH.dtype == torch.float8_e4m3fn
    assert device_path.aux_scale_TA.shape == device_path.aux_TAH.shape[:2]
    shipped = device_path.aux_TAH.nbytes + device_path.aux_scale_TA.nbytes
    assert shipped / bf16.aux_TAH.nbytes == pytest.approx((128 + 4) / (2 * 128))  # A·(H+4) vs A·2H bytes
    moved = device_path.to("cpu")
    assert moved.aux_TAH.dtype == torch.float8_e4m3fn  # as stored until the step
    assert torch.equal(moved.aux_states(), worker_path.aux_TAH)
    rows = torch.tensor([3, 0, 5])
    assert torch.equal(moved.aux_states(rows), worker_path.aux_TAH[rows])


def test_the_step_on_fp8_rows_equals_the_step_on_rows_dequantised_in_workers(fp8_store, tiny_store):
    from transformers import AutoConfig

    from peagle.model.draft import PEagleDraft
    from peagle.schemas.draft_config import DraftConfig
    from peagle.stages.train.step import DraftStep, unit_forward

    draft_config = DraftConfig.from_target_config(AutoConfig.from_pretrained(tiny_store.target_dir), num_layers=1,
                                                  draft_vocab_size=tiny_store.vocab_size,
                                                  mask_token_id=tiny_store.mask_token_id)
    torch.manual_seed(0)
    model = DraftStep(PEagleDraft(draft_config), num_depths=4)
    loss = []
    for in_workers in (True, False):
        batch = next(iter(TrainLoader(config(StoreSpec(str(fp8_store)), dequantize_in_workers=in_workers))))
        (plan,) = batch.units
        loss.append(unit_forward(model, batch, plan, attention="sdpa", compute_dtype=torch.float32)[0].loss_sum)
    assert torch.equal(loss[0], loss[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned host-to-device path needs a GPU")
def test_fp8_rows_go_pinned_to_the_gpu_as_codes_and_are_dequantised_there(fp8_store):
    cuda = torch.device("cuda")
    worker_path = next(iter(TrainLoader(config(StoreSpec(str(fp8_store))))))
    loader = TrainLoader(config(StoreSpec(str(fp8_store)), dequantize_in_workers=False, pin_memory=True,
                                num_workers=1))
    batch = next(iter(loader))
    assert batch.aux_TAH.dtype == torch.float8_e4m3fn and batch.aux_TAH.is_pinned() and batch.aux_scale_TA.is_pinned()
    on_gpu = batch.to(cuda, non_blocking=True)
    assert on_gpu.aux_TAH.device.type == "cuda" and on_gpu.aux_TAH.dtype == torch.float8_e4m3fn
    rows = torch.tensor([4, 1, 0], device=cuda)
    assert torch.equal(on_gpu.aux_states(rows).cpu(), worker_path.aux_TAH[rows.cpu()])
