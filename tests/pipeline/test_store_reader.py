"""The training reader (pipeline/store_reader.py): docs/indexing.md's shift against the raw files and the raw
reader (on a store written by hand and on one extracted from a real tiny target), aux byte ranges, and
the sample iterators."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.pipeline import store_reader as R
from peagle.pipeline.raw_reader import RawColumns, RawSample, iter_raw_shards, raw_sample
from peagle.pipeline.split import is_heldout
from peagle.pipeline.store import open_store
from peagle.schemas import store as S
from peagle.schemas.errors import UserError


def shifted_by_definition(ids: list[int], mask: list[int]) -> dict[str, list]:
    """docs/indexing.md written out position by position, for comparison."""
    n = len(ids)
    return {"tokens": [ids[p + 1] for p in range(n - 1)],
            "targets": [ids[p + 2] if p + 2 < n else -1 for p in range(n - 1)],
            "supervised": [bool(mask[p + 2]) if p + 2 < n else False for p in range(n - 1)]}


@settings(max_examples=60)
@given(st.lists(st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=9), max_size=6))
def test_shift_columns_is_design_section_3_for_every_sample(samples):
    ids = [t for s in samples for t, _ in s]
    mask = [m for s in samples for _, m in s]
    offsets = np.cumsum([0] + [len(s) for s in samples]).astype(np.int64)
    cols = R.shift_columns(RawColumns(sample_ids=[f"s{i}" for i in range(len(samples))], offsets=offsets,
                                      input_ids=np.array(ids, dtype=np.int64), loss_mask=np.array(mask, dtype=bool),
                                      token_offset=offsets[:-1]))
    assert cols.num_samples == len(samples) and cols.starts[-1] == len(ids) - len(samples)
    for i, s in enumerate(samples):
        a, b = cols.starts[i], cols.starts[i + 1]
        want = shifted_by_definition([t for t, _ in s], [m for _, m in s])
        assert cols.tokens[a:b].tolist() == want["tokens"]
        assert cols.targets[a:b].tolist() == want["targets"]
        assert cols.supervised[a:b].tolist() == want["supervised"]
        assert cols.first_tokens[i] == s[0][0]


TRAINING_FIELDS = ("tokens_T", "targets_T", "supervised_T", "aux_TAH", "topk_ids_Tk", "topk_logprobs_Tk")


def assert_is_raw_shifted(sample: R.TrainingSample, raw: RawSample) -> None:
    """``sample`` is docs/indexing.md applied to ``raw``, position by position."""
    ids, mask = raw.input_ids_n.tolist(), raw.loss_mask_n.tolist()
    want = shifted_by_definition(ids, mask)
    assert sample.sample_id == raw.sample_id and sample.num_positions == raw.num_tokens - 1
    assert sample.first_token == ids[0] and sample.input_ids_n.tolist() == ids
    assert sample.tokens_T.tolist() == want["tokens"] and sample.targets_T.tolist() == want["targets"]
    assert sample.supervised_T.tolist() == want["supervised"]
    assert torch.equal(sample.aux.values_TAH.view(torch.uint8), raw.aux.values_TAH[:-1].view(torch.uint8))  # aux[p]
    assert torch.equal(sample.aux_TAH, raw.aux_nAH[:-1])
    assert torch.equal(sample.topk_ids_Tk, raw.topk_ids_nk[1:])  # topk[p+1]
    assert torch.equal(sample.topk_logprobs_Tk, raw.topk_logprobs_nk[1:])


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=2, max_size=12), st.integers(0, 2**16))
def test_shift_sample_is_docs_indexing_for_any_raw_sample(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    raw = raw_sample("s", [t for t, _ in tokens], [m for _, m in tokens],
                     {S.AUX_HIDDEN: torch.randn(n, 2, 3, generator=g).to(torch.bfloat16),
                      S.TOPK_IDS: torch.randint(0, 50, (n, 4), generator=g, dtype=torch.int32),
                      S.TOPK_LOGPROBS: torch.randn(n, 4, generator=g).half()})
    assert_is_raw_shifted(R.shift_sample(raw), raw)


@pytest.fixture(scope="module", params=S.HIDDEN_DTYPES)
def extracted_store(request, tmp_path_factory, tiny_llama):
    """A store that `peagle extract` wrote from the tiny Llama target (HF backend): 14 chats, 3 shards."""
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.testing.chat_data import write_chat_jsonl

    root = tmp_path_factory.mktemp(f"extracted-{request.param}")
    data = write_chat_jsonl(root / "chats.jsonl", 14, seed=3)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), backend="hf", topk=4,
                              samples_per_shard=5, device="cpu", max_seq_len=256, hidden_dtype=request.param),
                echo=lambda _: None, progress=False)
    return open_store(root / "store")


def test_training_samples_of_an_extracted_store_are_its_raw_samples_shifted(extracted_store):
    store = extracted_store
    raws = [(position, row, sample) for position, shard in enumerate(iter_raw_shards(store))
            for row, sample in enumerate(shard.samples())]
    training = list(R.iter_training_samples(store))
    assert len(store.shards) == 3 and len(training) == len(raws) == store.num_samples
    assert sum(int(s.supervised_T.sum()) for s in training) > 0
    reader = R.ShardReader([store], capacity=2)
    for (position, row, raw), sample in zip(raws, training, strict=True):
        assert_is_raw_shifted(sample, raw)
        for name in TRAINING_FIELDS:  # the loader's reader and one raw sample shifted alone: the same arrays
            assert torch.equal(getattr(reader.sample(0, position, row), name), getattr(sample, name)), name
            assert torch.equal(getattr(R.shift_sample(raw), name), getattr(sample, name)), name


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
    for name in TRAINING_FIELDS:
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


def test_an_unknown_hidden_dtype_is_refused_in_one_line(tmp_path, write_store):
    import json

    write_store(tmp_path / "s", [[3]])
    settings_file = tmp_path / "s" / S.STORE_SETTINGS_FILE
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "hidden_dtype": "int4"}))
    with pytest.raises(UserError, match=r"holds hidden states as 'int4', this peagle reads bf16\|fp8$"):
        open_store(tmp_path / "s")
