"""The store reader (pipeline/store_reader.py): docs/indexing.md's shift against the raw files, the shard
tensor layout and header, memory-mapped tensors, aux byte ranges, and the sample iterators."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from peagle.pipeline import fp8
from peagle.pipeline import store_reader as R
from peagle.pipeline.safetensors_file import encode_header
from peagle.pipeline.split import is_heldout
from peagle.pipeline.store import commit_shard, init_store, open_store, write_shard_file
from peagle.schemas import store as S
from peagle.schemas.errors import UserError

TARGET = S.TargetIdentity(path="/models/t", architecture="LlamaForCausalLM", num_hidden_layers=8,
                          hidden_size=16, vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t" * 64, chat_template_hash="h" * 64,
                           aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=128, logprob_dtype="float16",
                           loss_on="all", mask_token_id=7)


@dataclass(frozen=True)
class RawSample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    aux_nAH: torch.Tensor  # the states (bf16; dequantised for fp8)
    topk_ids_nk: torch.Tensor
    topk_logprobs_nk: torch.Tensor
    stored_nAH: torch.Tensor  # aux_hidden as written (bf16 states or fp8 codes)
    scale_nA: torch.Tensor | None  # aux_scale (fp8)


@dataclass(frozen=True)
class RawStore:
    root: Path
    samples: dict[str, RawSample]
    order: list[str]


def write_parquet_rows(path: Path, rows: list[RawSample]) -> None:
    lengths = [len(r.input_ids) for r in rows]
    pq.write_table(pa.table({
        "sample_id": [r.sample_id for r in rows], "source": [f"a.jsonl:{i}" for i in range(len(rows))],
        "input_ids": pa.array([r.input_ids for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([r.loss_mask for r in rows], pa.list_(pa.uint8())),
        "num_tokens": lengths, "token_offset": list(np.cumsum([0] + lengths[:-1]).tolist()),
    }), path)


def write_raw_store(root: Path, lengths_of_shards: list[list[int]], seed: int = 0,
                    hidden_dtype: str = S.HIDDEN_BF16) -> RawStore:
    """A store written through the commit protocol, with random rows shaped as extract writes them
    (ragged samples, uint8 loss masks, bf16 or fp8 aux, int32 top-k ids, fp16 log-probs)."""
    g = torch.Generator().manual_seed(seed)
    settings = replace(SETTINGS, hidden_dtype=hidden_dtype)
    init_store(root, settings)
    samples, order = {}, []
    for index, lengths in enumerate(lengths_of_shards):
        rows = []
        for n in lengths:
            sid = f"{index}-{len(rows)}"
            states = torch.randn(n, 3, 16, generator=g).to(torch.bfloat16)
            stored, scale = fp8.quantize(states) if hidden_dtype == S.HIDDEN_FP8 else (states, None)
            rows.append(RawSample(sid, torch.randint(0, 64, (n,), generator=g).tolist(),
                                  (torch.rand(n, generator=g) < 0.6).int().tolist(),
                                  states if scale is None else fp8.dequantize(stored, scale),
                                  torch.randint(0, 64, (n, 4), generator=g, dtype=torch.int32),
                                  (-torch.rand(n, 4, generator=g).sort(dim=1).values * 4).half(), stored, scale))
            samples[sid] = rows[-1]
            order.append(sid)
        layout = R.tensor_layout(settings, sum(lengths))

        def write_tensors(tmp, rows=rows, layout=layout):
            with open(tmp, "wb") as f:
                f.write(encode_header(layout))
                for name in layout:
                    for r in rows:
                        t = {S.AUX_HIDDEN: r.stored_nAH, S.AUX_SCALE: r.scale_nA, S.TOPK_IDS: r.topk_ids_nk,
                             S.TOPK_LOGPROBS: r.topk_logprobs_nk}[name]
                        f.write(t.contiguous().view(torch.uint8).numpy().tobytes())

        pq_bytes, pq_sha = write_shard_file(root, S.parquet_name(index), lambda tmp, rows=rows: write_parquet_rows(tmp, rows))
        st_bytes, st_sha = write_shard_file(root, S.tensors_name(index), write_tensors)
        commit_shard(root, S.ShardRecord(
            index=index, parquet=S.parquet_name(index), safetensors=S.tensors_name(index), num_samples=len(rows),
            num_tokens=sum(lengths), parquet_bytes=pq_bytes, safetensors_bytes=st_bytes, parquet_sha256=pq_sha,
            safetensors_sha256=st_sha, input_file="a.jsonl", first_record=0, end_record=len(rows),
            num_records=len(rows)))
    return RawStore(root, samples, order)


@pytest.fixture(params=S.HIDDEN_DTYPES)
def raw_store(tmp_path, request) -> RawStore:
    return write_raw_store(tmp_path / "store", [[5, 2, 9], [3], [12, 4, 2, 7]], hidden_dtype=request.param)


def shifted_by_definition(ids: list[int], mask: list[int]) -> dict[str, list]:
    """docs/indexing.md written out position by position, for comparison."""
    n = len(ids)
    return {"tokens": [ids[p + 1] for p in range(n - 1)],
            "targets": [ids[p + 2] if p + 2 < n else -1 for p in range(n - 1)],
            "supervised": [bool(mask[p + 2]) if p + 2 < n else False for p in range(n - 1)]}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=9), max_size=6))
def test_shift_columns_is_design_section_3_for_every_sample(samples):
    ids = [t for s in samples for t, _ in s]
    mask = [m for s in samples for _, m in s]
    offsets = np.cumsum([0] + [len(s) for s in samples])
    cols = R.shift_columns([f"s{i}" for i in range(len(samples))], np.array(ids, dtype=np.int64),
                           np.array(mask, dtype=np.uint8), offsets, offsets[:-1])
    assert cols.num_samples == len(samples) and cols.starts[-1] == len(ids) - len(samples)
    for i, s in enumerate(samples):
        a, b = cols.starts[i], cols.starts[i + 1]
        want = shifted_by_definition([t for t, _ in s], [m for _, m in s])
        assert cols.tokens[a:b].tolist() == want["tokens"]
        assert cols.targets[a:b].tolist() == want["targets"]
        assert cols.supervised[a:b].tolist() == want["supervised"]
        assert cols.first_tokens[i] == s[0][0]


def test_samples_read_from_a_real_store_are_the_raw_rows_shifted(raw_store):
    store = open_store(raw_store.root)
    samples = list(R.iter_training_samples(store))
    assert [s.sample_id for s in samples] == raw_store.order
    for sample in samples:
        raw = raw_store.samples[sample.sample_id]
        n = len(raw.input_ids)
        want = shifted_by_definition(raw.input_ids, raw.loss_mask)
        assert sample.num_positions == n - 1 and sample.input_ids_n.tolist() == raw.input_ids
        assert sample.tokens_T.tolist() == want["tokens"] and sample.targets_T.tolist() == want["targets"]
        assert sample.supervised_T.tolist() == want["supervised"]
        assert torch.equal(sample.aux_TAH, raw.aux_nAH[: n - 1])  # aux[p]
        assert torch.equal(sample.topk_ids_Tk, raw.topk_ids_nk[1:])  # topk[p+1]
        assert torch.equal(sample.topk_logprobs_Tk, raw.topk_logprobs_nk[1:])
    held = [s.sample_id for s in R.iter_training_samples(store, heldout_fraction=0.5)]
    assert held == [i for i in raw_store.order if is_heldout(i, 0.5)] and 0 < len(held) < len(samples)
    assert len(list(R.iter_training_samples(store, max_samples=4))) == 4


def test_a_raw_sample_goes_through_the_same_shift(raw_store):
    raw = next(iter(raw_store.samples.values()))
    one = R.training_sample(raw.sample_id, torch.tensor(raw.input_ids), torch.tensor(raw.loss_mask), raw.stored_nAH,
                            raw.topk_ids_nk, raw.topk_logprobs_nk, raw.scale_nA)
    from_store = next(s for s in R.iter_training_samples(open_store(raw_store.root)) if s.sample_id == raw.sample_id)
    for name in ("tokens_T", "targets_T", "supervised_T", "aux_TAH", "topk_ids_Tk", "topk_logprobs_Tk"):
        assert torch.equal(getattr(one, name), getattr(from_store, name)), name


def test_context_before_first_target():
    sample = R.training_sample("s", torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 0, 0, 1, 1]),
                               torch.zeros(5, 1, 2), torch.zeros(5, 1, dtype=torch.int32), torch.zeros(5, 1))
    assert sample.context_before_first_target() == [5, 6, 7]  # x_3 is the first charged token
    unsupervised = R.training_sample("u", torch.tensor([5, 6]), torch.tensor([1, 1]), torch.zeros(2, 1, 2),
                                     torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 1))
    assert unsupervised.context_before_first_target() is None  # loss_mask[0], [1] are never charged


def test_shard_reader_aux_byte_ranges_hold_exactly_the_training_rows(raw_store):
    store = open_store(raw_store.root)
    reader = R.ShardReader([store], capacity=2)
    for shard in range(len(store.shards)):
        for row in range(reader.columns(0, shard).num_samples):
            sample = reader.sample(0, shard, row)
            values, scales = reader.aux_read(0, shard, row)
            raw = raw_store.samples[sample.sample_id]
            assert (scales is None) == (raw.scale_nA is None)
            source = R.AuxSource(tuple(sample.aux_TAH.shape), raw.stored_nAH.dtype, (values,),
                                 None if scales is None else (scales,))
            read = source.read()
            assert read.values_TAH.dtype == raw.stored_nAH.dtype  # as stored: fp8 stays fp8
            assert torch.equal(read.values_TAH.view(torch.uint8), raw.stored_nAH[:-1].view(torch.uint8))
            assert torch.equal(read.states(), sample.aux_TAH)
            assert torch.equal(sample.aux_TAH, raw.aux_nAH[:-1]) and sample.aux_TAH.dtype == torch.bfloat16


def test_tensor_layout_and_bytes_per_token():
    layout = R.tensor_layout(SETTINGS, 7)
    assert list(layout) == list(S.TENSOR_NAMES)
    assert layout[S.AUX_HIDDEN] == ((7, 3, 16), torch.bfloat16) and layout[S.TOPK_IDS] == ((7, 4), torch.int32)
    assert layout[S.TOPK_LOGPROBS][1] == torch.float16
    assert R.raw_bytes_per_token(SETTINGS) == 3 * 16 * 2 + 4 * (4 + 2)
    assert R.raw_bytes_per_token(replace(SETTINGS, logprob_dtype="float32")) == 3 * 16 * 2 + 4 * 8


def test_fp8_layout_scales_and_safetensors_compatibility(tmp_path):
    """An fp8 shard: codes in aux_hidden (F8_E4M3), one float32 scale per (token, layer) in aux_scale
    right after it, top-k unchanged; loadable by safetensors itself."""
    settings = replace(SETTINGS, hidden_dtype=S.HIDDEN_FP8)
    layout = R.tensor_layout(settings, 7)
    assert list(layout) == [S.AUX_HIDDEN, S.AUX_SCALE, S.TOPK_IDS, S.TOPK_LOGPROBS]
    assert layout[S.AUX_HIDDEN] == ((7, 3, 16), torch.float8_e4m3fn) and layout[S.AUX_SCALE] == ((7, 3), torch.float32)
    assert layout[S.TOPK_LOGPROBS] == R.tensor_layout(SETTINGS, 7)[S.TOPK_LOGPROBS]  # top-k keeps its dtype
    assert R.raw_bytes_per_token(settings) == 3 * (16 + 4) + 4 * (4 + 2)
    states = torch.randn(7, 3, 16).to(torch.bfloat16)
    codes, scale = fp8.quantize(states)
    tensors = {S.AUX_HIDDEN: codes, S.AUX_SCALE: scale, S.TOPK_IDS: torch.zeros(7, 4, dtype=torch.int32),
               S.TOPK_LOGPROBS: torch.zeros(7, 4, dtype=torch.float16)}
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        f.write(encode_header(layout))
        for t in tensors.values():
            f.write(t.view(torch.uint8).numpy().tobytes())
    loaded = load_file(str(path))
    assert loaded[S.AUX_HIDDEN].dtype == torch.float8_e4m3fn and torch.equal(loaded[S.AUX_SCALE], scale)
    mapped = R.map_tensors(path)
    assert torch.equal(mapped[S.AUX_HIDDEN].view(torch.uint8), codes.view(torch.uint8))
    assert R.read_header(path)[S.AUX_HIDDEN].row_bytes == 3 * 16
    assert torch.equal(R.stored_aux(mapped).states(), fp8.dequantize(codes, scale))


def test_an_unknown_hidden_dtype_is_refused_in_one_line(tmp_path):
    import json

    write_raw_store(tmp_path / "s", [[3]])
    settings_file = tmp_path / "s" / S.STORE_SETTINGS_FILE
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "hidden_dtype": "int4"}))
    with pytest.raises(UserError, match=r"holds hidden states as 'int4', this peagle reads bf16\|fp8$"):
        open_store(tmp_path / "s")


def test_ragged_columns_and_a_damaged_tensor_file_are_one_line(raw_store):
    store = open_store(raw_store.root)
    copy = raw_store.root
    path = copy / store.shards[0].parquet
    table = pq.read_table(path)
    masks = table.column("loss_mask").to_pylist()
    masks[0] = masks[0][:-1]
    pq.write_table(table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                                    pa.array(masks, pa.list_(pa.uint8()))), path)
    with pytest.raises(UserError, match="different lengths"):
        R.read_columns(store, store.shards[0].index)
    (copy / store.shards[1].safetensors).write_bytes(b"\xff" * 64)
    with pytest.raises(UserError, match="is damaged") as err:
        R.open_shard_tensors(store, store.shards[1].index)
    assert "\n" not in str(err.value)
