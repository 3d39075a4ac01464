"""A store written by hand for the reader tests: through the commit protocol (``shard_commit``) and the
safetensors header writer, but not through extract's writer, the Parquet file's (``shard_parquet``) or the
readers under test, so that what they read back can be compared with what was written."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from peagle.pipeline import fp8
from peagle.pipeline.safetensors_file import encode_header
from peagle.pipeline.shard_tensors import tensor_layout
from peagle.pipeline.shard_commit import write_and_commit_shard
from peagle.pipeline.store import init_store
from peagle.schemas import store as S

TARGET = S.TargetIdentity(path="/models/t", architecture="LlamaForCausalLM", num_hidden_layers=8,
                          hidden_size=16, vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t" * 64, chat_template_hash="h" * 64,
                           aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=128, logprob_dtype="float16",
                           loss_on="all", mask_token_id=7)


@dataclass(frozen=True)
class WrittenSample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    aux_nAH: torch.Tensor  # the states (bf16; dequantised for fp8)
    topk_ids_nk: torch.Tensor
    topk_logprobs_nk: torch.Tensor
    stored_nAH: torch.Tensor  # aux_hidden as written (bf16 states or fp8 codes)
    scale_nA: torch.Tensor | None  # aux_scale (fp8)


@dataclass(frozen=True)
class WrittenStore:
    root: Path
    samples: dict[str, WrittenSample]
    order: list[str]


def write_parquet_rows(path: Path, rows: list[WrittenSample]) -> None:
    lengths = [len(r.input_ids) for r in rows]
    pq.write_table(pa.table({
        "sample_id": [r.sample_id for r in rows], "source": [f"a.jsonl:{i}" for i in range(len(rows))],
        "input_ids": pa.array([r.input_ids for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([r.loss_mask for r in rows], pa.list_(pa.uint8())),
        "num_tokens": lengths, "token_offset": list(np.cumsum([0] + lengths[:-1]).tolist()),
    }), path)


def write_raw_store(root: Path, lengths_of_shards: list[list[int]], seed: int = 0,
                    hidden_dtype: str = S.HIDDEN_BF16) -> WrittenStore:
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
            rows.append(WrittenSample(sid, torch.randint(0, 64, (n,), generator=g).tolist(),
                                  (torch.rand(n, generator=g) < 0.6).int().tolist(),
                                  states if scale is None else fp8.dequantize(stored, scale),
                                  torch.randint(0, 64, (n, 4), generator=g, dtype=torch.int32),
                                  (-torch.rand(n, 4, generator=g).sort(dim=1).values * 4).half(), stored, scale))
            samples[sid] = rows[-1]
            order.append(sid)
        layout = tensor_layout(settings, sum(lengths))

        def write_tensors(tmp, rows=rows, layout=layout):
            with open(tmp, "wb") as f:
                f.write(encode_header(layout))
                for name in layout:
                    for r in rows:
                        t = {S.AUX_HIDDEN: r.stored_nAH, S.AUX_SCALE: r.scale_nA, S.TOPK_IDS: r.topk_ids_nk,
                             S.TOPK_LOGPROBS: r.topk_logprobs_nk}[name]
                        f.write(t.contiguous().view(torch.uint8).numpy().tobytes())

        record = S.ShardRecord(
            index=index, parquet=S.parquet_name(index), safetensors=S.tensors_name(index), num_samples=len(rows),
            num_tokens=sum(lengths), parquet_bytes=0, safetensors_bytes=0, parquet_sha256="", safetensors_sha256="",
            input_file="a.jsonl", first_record=0, end_record=len(rows), num_records=len(rows))
        write_and_commit_shard(root, record, write_rows=lambda tmp, rows=rows: write_parquet_rows(tmp, rows),
                               write_tensors=write_tensors)
    return WrittenStore(root, samples, order)


@pytest.fixture(params=S.HIDDEN_DTYPES)
def raw_store(tmp_path, request) -> WrittenStore:
    """Three shards of ragged samples, bf16 and fp8."""
    return write_raw_store(tmp_path / "store", [[5, 2, 9], [3], [12, 4, 2, 7]], hidden_dtype=request.param)


@pytest.fixture
def write_store():
    """``write_raw_store`` itself, for tests that write stores of their own shapes."""
    return write_raw_store
