"""Training items and batches: docs/indexing.md index shifting against the raw store, packing, targets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from peagle.model.mask import dense_mask, dense_peagle_mask
from peagle.pipeline.store_reader import training_sample
from peagle.schemas.loader_config import CodSettings
from peagle.stages.train.batch import TrainBatch, collate, make_item
from peagle.stages.train.cod import cod_generator, generate_cod_sample_indices

COD = CodSettings(num_depths=4, down_sample_ratio=0.7, down_sample_ratio_min=0.2)


def item_of(raw, *, seed=0, epoch=0, cod=COD):
    sample = training_sample(raw.sample_id, torch.tensor(raw.input_ids), torch.tensor(raw.loss_mask), raw.aux_nAH,
                             raw.topk_ids_nk, raw.topk_logprobs_nk)
    return make_item(sample, cod=cod, seed=seed, epoch=epoch)


def supervised_samples(store, count):
    return [s for s in store.samples.values() if sum(s.loss_mask[2:]) > 0][:count]


def test_item_is_the_shifted_sample_with_its_seeded_cod_draw(tiny_store):
    raw = supervised_samples(tiny_store, 1)[0]
    item = item_of(raw, seed=3, epoch=1)
    n = len(raw.input_ids)
    assert item.num_positions == n - 1
    assert item.tokens_T.tolist() == raw.input_ids[1:]  # the shift itself: tests/pipeline/test_store_reader.py
    # The COD draw is the seeded one of (seed, epoch, sample_id) over the shifted mask.
    anchor, depth = generate_cod_sample_indices(n - 1, item.supervised_T, 4, 0.7, 0.2, True,
                                                generator=cod_generator(3, 1, raw.sample_id))
    assert torch.equal(item.anchor_pos, anchor) and torch.equal(item.depth, depth)


def test_item_depends_only_on_seed_epoch_and_sample_id(tiny_store):
    raw = max(tiny_store.samples.values(), key=lambda s: sum(s.loss_mask))
    same = item_of(raw, seed=1, epoch=4), item_of(raw, seed=1, epoch=4)
    assert torch.equal(same[0].anchor_pos, same[1].anchor_pos) and torch.equal(same[0].depth, same[1].depth)
    assert not torch.equal(item_of(raw, seed=1, epoch=5).anchor_pos, same[0].anchor_pos)
    assert not torch.equal(item_of(raw, seed=2, epoch=4).anchor_pos, same[0].anchor_pos)


def test_batch_targets_are_the_raw_topk_at_reference_position_plus_one(tiny_store):
    raws = supervised_samples(tiny_store, 3)
    vocab_size = tiny_store.vocab_size
    batch = collate([item_of(r) for r in raws], target_to_draft_V=torch.arange(vocab_size))
    starts = batch.doc_starts_D.tolist()
    assert batch.doc_lengths_D.tolist() == [len(r.input_ids) - 1 for r in raws]
    assert batch.num_tokens == sum(len(r.input_ids) - 1 for r in raws) == batch.tokens_T.numel()
    assert batch.aux_TAH.shape == (batch.num_tokens, *raws[0].aux_nAH.shape[1:])
    assert batch.num_no_target == 0  # identity vocab: every top-k id is in it

    expected_supervised = []
    for i in range(batch.num_elements):
        a, d = int(batch.anchor_N[i]), int(batch.depth_N[i])
        doc = max(j for j, s in enumerate(starts) if s <= a)
        raw, local = raws[doc], a - starts[doc]
        ref = local + d  # reference position in the sample
        assert int(batch.position_ids_N[i]) == ref
        if d == 0:  # the draft's real rows: their input token and aux state (deeper elements read neither)
            assert i == a and torch.equal(batch.aux_TAH[a], raw.aux_nAH[local])
            assert int(batch.tokens_T[a]) == raw.input_ids[local + 1]
        if ref + 2 < len(raw.input_ids) and raw.loss_mask[ref + 2]:
            expected_supervised.append((i, raw, ref))
    assert batch.supervised_idx_E.tolist() == [i for i, _, _ in expected_supervised]
    assert batch.num_supervised == len(expected_supervised) > 0
    for e, (i, raw, ref) in enumerate(expected_supervised):
        assert batch.target_ids_Ek[e].tolist() == raw.topk_ids_nk[ref + 1].tolist()
        probs = raw.topk_logprobs_nk[ref + 1].float().exp()
        torch.testing.assert_close(batch.target_probs_Ek[e], probs / probs.sum())
        assert int(batch.depth_E[e]) == int(batch.depth_N[i])


def test_draft_vocab_restriction_renormalises_and_counts_uncovered(tiny_store):
    raws = supervised_samples(tiny_store, 4)
    v = tiny_store.vocab_size
    # A draft vocab of every third id: some top-k rows are partly covered, some not at all.
    selected = torch.arange(0, v, 3)
    t2d = torch.full((v,), -1, dtype=torch.long)
    t2d[selected] = torch.arange(selected.numel())
    items = [item_of(r) for r in raws]
    full = collate(items, target_to_draft_V=torch.arange(v))
    batch = collate(items, target_to_draft_V=t2d)
    assert batch.num_supervised + batch.num_no_target == full.num_supervised
    keep = [j for j in range(full.num_supervised) if bool((full.target_ids_Ek[j] % 3 == 0).any())]
    assert batch.supervised_idx_E.tolist() == full.supervised_idx_E[keep].tolist()
    for e, j in enumerate(keep):
        ids, probs = full.target_ids_Ek[j], full.target_probs_Ek[j]
        in_vocab = ids % 3 == 0
        assert batch.target_ids_Ek[e].tolist() == torch.where(in_vocab, ids // 3, -1).tolist()
        expected = torch.where(in_vocab, probs, 0.0)
        torch.testing.assert_close(batch.target_probs_Ek[e], expected / expected.sum())


def test_packing_isolates_documents_and_block_indices_cover_the_mask(tiny_store):
    raws = supervised_samples(tiny_store, 3)
    batch = collate([item_of(r) for r in raws], target_to_draft_V=torch.arange(tiny_store.vocab_size),
                    block_size=16)
    dense = dense_peagle_mask(batch.anchor_N, batch.depth_N, batch.doc_lengths_D, batch.num_tokens)
    assert torch.equal(dense_mask(batch.anchor_N, batch.depth_N, batch.doc_N), dense)  # shipped doc ids
    (unit,) = batch.units
    assert unit.element_idx_M is None and unit.num_real == batch.num_tokens and unit.target_idx_e is None
    assert torch.equal(unit.supervised_idx_e, batch.supervised_idx_E)
    idx = unit.block_indices
    nb = idx.kv_num_blocks.shape[-1]
    allowed = torch.zeros(nb, nb, dtype=torch.bool)
    for q in range(nb):
        for table, count in ((idx.kv_indices, idx.kv_num_blocks), (idx.full_kv_indices, idx.full_kv_num_blocks)):
            allowed[q, table[0, 0, q, : int(count[0, 0, q])].long()] = True
    q, k = torch.nonzero(dense, as_tuple=True)
    assert bool(allowed[q // 16, k // 16].all())
    doc = torch.searchsorted(batch.doc_starts_D, batch.anchor_N, right=True) - 1
    assert bool((doc[q] == doc[k]).all())  # no element sees another sample


def test_segments_partition_the_elements(tiny_store):
    raws = supervised_samples(tiny_store, 2)
    batch = collate([item_of(r) for r in raws], target_to_draft_V=torch.arange(tiny_store.vocab_size),
                    num_segments=3, block_size=16)
    assert len(batch.units) == 3
    for unit in batch.units:
        assert unit.block_indices.seq_len == unit.element_idx_M.numel()
        assert bool((batch.depth_N[unit.element_idx_M[:unit.num_real]] == 0).all())
        assert bool((batch.depth_N[unit.element_idx_M[unit.num_real:]] > 0).all())
    # Every supervised element is charged by exactly one unit, at its own row.
    charged = torch.cat([u.element_idx_M[u.supervised_idx_e] for u in batch.units])
    assert sorted(charged.tolist()) == batch.supervised_idx_E.tolist()
    targets = torch.cat([u.target_idx_e for u in batch.units])
    assert sorted(targets.tolist()) == list(range(batch.num_supervised))
    for u in batch.units:
        assert torch.equal(u.element_idx_M[u.supervised_idx_e], batch.supervised_idx_E[u.target_idx_e])


def test_to_and_pin_memory_keep_every_field(tiny_store):
    raws = supervised_samples(tiny_store, 2)
    batch = collate([item_of(r) for r in raws], target_to_draft_V=torch.arange(tiny_store.vocab_size),
                    num_segments=2, block_size=16)
    moved = batch.to("cpu")
    assert isinstance(moved, TrainBatch) and torch.equal(moved.aux_TAH, batch.aux_TAH)
    assert moved.sample_ids == batch.sample_ids and moved.units[1].block_indices.block_size == 16
    if not torch.cuda.is_available():
        pytest.skip("pin_memory needs an accelerator")
    pinned = batch.pin_memory()
    assert pinned.aux_TAH.is_pinned() and pinned.units[0].element_idx_M.is_pinned() and pinned.doc_N.is_pinned()
    assert pinned.units[0].block_indices.kv_indices.is_pinned()


def test_chain_targets_name_each_complete_chain_and_reject_where_no_target(tiny_store):
    """``chain_target_idx_CK`` against the definition, element by element: one row per anchor with a
    depth-(K−1) element and a supervised depth-0 element, column d its depth-d element's target, E
    (a rejection) where that element was dropped for having no draft-vocab id.

    Which chains reject is made certain, not left to the data: in a draft vocab of every 8th id, the
    first chain's targets each get an id in it and the last chain's deepest target none (the COD draw,
    and so the chains, depend on the sample ids and loss masks alone, not on the top-k rows)."""
    raws = supervised_samples(tiny_store, 4)
    v, K = tiny_store.vocab_size, 3
    selected = torch.arange(0, v, 8)  # a small draft vocab: some chain elements have no target
    t2d = torch.full((v,), -1, dtype=torch.long)
    t2d[selected] = torch.arange(selected.numel())
    cod = CodSettings(num_depths=K, down_sample_ratio=0.9, down_sample_ratio_min=0.5)
    drawn = collate([item_of(r, cod=cod) for r in raws], target_to_draft_V=t2d)
    chains = sorted(int(a) for a, d in zip(drawn.anchor_N, drawn.depth_N) if d == K - 1 and bool(drawn.supervised_T[a]))
    assert len(chains) >= 2
    starts = drawn.doc_starts_D.tolist()

    def raw_row(anchor: int, depth: int) -> tuple[int, int]:
        """(sample, raw top-k row) of the target of element (anchor, depth): reference position + 1."""
        doc = max(j for j, s in enumerate(starts) if s <= anchor)
        return doc, anchor - starts[doc] + depth + 1

    topk = [r.topk_ids_nk.clone() for r in raws]
    for doc, row in (raw_row(chains[0], d) for d in range(K)):  # the first chain: each target in the vocab
        ids = topk[doc][row]
        ids[0] = next(int(i) for i in selected if int(i) not in ids.tolist())
    doc, row = raw_row(chains[-1], K - 1)  # the last chain's deepest target: no id in the vocab
    topk[doc][row] = torch.arange(1, v, 8)[: topk[doc].shape[1]]
    raws = [replace(r, topk_ids_nk=ids) for r, ids in zip(raws, topk)]
    batch = collate([item_of(r, cod=cod) for r in raws], target_to_draft_V=t2d)
    E = batch.num_supervised
    target_of = {int(i): e for e, i in enumerate(batch.supervised_idx_E)}
    element_of = {(int(a), int(d)): i for i, (a, d) in enumerate(zip(batch.anchor_N, batch.depth_N))}
    want = [[target_of.get(element_of[(a, d)], E) for d in range(K)]
            for (a, depth) in sorted(element_of, key=lambda ad: (ad[1], ad[0]))
            if depth == K - 1 and bool(batch.supervised_T[a])]
    assert batch.chain_target_idx_CK.tolist() == want and len(want) == len(chains)
    assert E not in want[0] and want[-1][K - 1] == E
    # A supervised element without a target is what breaks a chain here: nothing else maps to E.
    dropped = {element_of[(a, d)] for a, d in element_of if bool(batch.supervised_T[a + d])} - set(target_of)
    assert len(dropped) == batch.num_no_target
