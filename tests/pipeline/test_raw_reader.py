"""The raw reader (pipeline/raw_reader.py): a store's samples as stored, by token index i, against what
was written; any ragged shard splits into exactly its samples' rows; bad files are one line."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.pipeline import raw_reader as RR
from peagle.pipeline.shard_tensors import open_shard_tensors
from peagle.pipeline.store import open_store
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.testing.store_faults import recommit


def test_raw_samples_are_the_rows_as_written(raw_store):
    store = open_store(raw_store.root)
    seen = []
    for position, shard in enumerate(RR.iter_raw_shards(store)):
        assert shard.index == store.shards[position].index
        for row, sample in enumerate(shard.samples()):
            written = raw_store.samples[sample.sample_id]
            n = len(written.input_ids)
            assert sample.num_tokens == n and sample.input_ids_n.dtype == torch.int64
            assert sample.input_ids_n.tolist() == written.input_ids
            assert sample.loss_mask_n.tolist() == [bool(m) for m in written.loss_mask]
            assert torch.equal(sample.aux.values_TAH.view(torch.uint8), written.stored_nAH.view(torch.uint8))
            assert torch.equal(sample.aux_nAH, written.aux_nAH)  # fp8: dequantised as written
            assert torch.equal(sample.topk_ids_nk, written.topk_ids_nk)
            assert torch.equal(sample.topk_logprobs_nk, written.topk_logprobs_nk)
            # topk[i] is the distribution of x_{i+1}: the pairs a row's prediction is judged by
            assert sample.next_tokens_n1.tolist() == written.input_ids[1:]
            assert sample.next_supervised_n1.tolist() == [bool(m) for m in written.loss_mask[1:]]
            assert shard.columns.row_of(sample.sample_id) == row
            seen.append((shard.index, sample.sample_id))
    assert [sid for _, sid in seen] == raw_store.order


@settings(max_examples=50)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=6), st.integers(0, 3), st.integers(0, 2**16))
def test_a_ragged_shard_splits_into_exactly_its_samples_rows(lengths, gap, seed):
    """Samples at any token offsets (``gap`` unused rows in front and between) read back as exactly their
    rows, and a sample's own columns read it back unchanged."""
    g = torch.Generator().manual_seed(seed)
    starts = [gap + sum(lengths[:i]) + i * gap for i in range(len(lengths))]
    num_rows = starts[-1] + lengths[-1] + gap
    tensors = {S.AUX_HIDDEN: torch.randn(num_rows, 2, 3, generator=g).to(torch.bfloat16),
               S.TOPK_IDS: torch.randint(0, 50, (num_rows, 4), generator=g, dtype=torch.int32),
               S.TOPK_LOGPROBS: torch.randn(num_rows, 4, generator=g).half()}
    ids = torch.randint(0, 50, (sum(lengths),), generator=g).numpy()
    mask = (torch.rand(sum(lengths), generator=g) < 0.5).numpy()
    offsets = np.cumsum([0, *lengths]).astype(np.int64)
    columns = RR.RawColumns(sample_ids=[f"s{i}" for i in range(len(lengths))], offsets=offsets, input_ids=ids,
                            loss_mask=mask, token_offset=np.array(starts, dtype=np.int64))
    shard = RR.RawShard(0, columns, tensors)
    for row, sample in enumerate(shard.samples()):
        rows = slice(starts[row], starts[row] + lengths[row])
        assert columns.tensor_rows(row) == rows and sample.num_tokens == lengths[row]
        assert sample.input_ids_n.tolist() == ids[offsets[row]:offsets[row + 1]].tolist()
        assert sample.loss_mask_n.tolist() == mask[offsets[row]:offsets[row + 1]].tolist()
        assert torch.equal(sample.aux_nAH, tensors[S.AUX_HIDDEN][rows])
        assert torch.equal(sample.topk_ids_nk, tensors[S.TOPK_IDS][rows])
        assert torch.equal(sample.topk_logprobs_nk, tensors[S.TOPK_LOGPROBS][rows])
        alone = RR.RawShard(0, sample.columns(), {S.AUX_HIDDEN: sample.aux.values_TAH, S.TOPK_IDS: sample.topk_ids_nk,
                                                   S.TOPK_LOGPROBS: sample.topk_logprobs_nk}).sample(0)
        for name in ("input_ids_n", "loss_mask_n", "aux_nAH", "topk_ids_nk", "topk_logprobs_nk"):
            assert torch.equal(getattr(alone, name), getattr(sample, name)), name


def test_ragged_columns_and_a_damaged_tensor_file_are_one_line(raw_store):
    """Files a buggy extractor committed so (their checksums match: ``recommit``)."""
    store = open_store(raw_store.root)
    path = raw_store.root / store.shards[0].parquet
    table = pq.read_table(path)
    masks = table.column("loss_mask").to_pylist()
    masks[0] = masks[0][:-1]
    pq.write_table(table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                                    pa.array(masks, pa.list_(pa.uint8()))), path)
    (raw_store.root / store.shards[1].safetensors).write_bytes(b"\xff" * 64)
    for record in store.shards[:2]:
        recommit(raw_store.root, record.index)
    store = open_store(raw_store.root)
    with pytest.raises(UserError, match="different lengths"):
        RR.read_raw_columns(store, store.shards[0].index)
    with pytest.raises(UserError, match="is damaged") as err:
        open_shard_tensors(store, store.shards[1].index)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="is damaged"):
        RR.open_raw_shard(store, store.shards[1].index)
