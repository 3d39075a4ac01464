"""Real shard stores for the train-stage data tests: a real tiny extraction (``peagle extract``'s
stage, HF backend, in this process to save the interpreter start) of synthetic chat data.

Tests compare what the loader yields with the raw files, read back here independently of
``peagle.pipeline.store`` (pyarrow for the Parquet rows, ``safetensors.safe_open`` for the tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from peagle.testing.chat_data import write_chat_jsonl

TOPK = 8


@dataclass(frozen=True)
class RawSample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    shard: int
    aux_nAH: torch.Tensor
    topk_ids_nk: torch.Tensor
    topk_logprobs_nk: torch.Tensor


@dataclass(frozen=True)
class TinyStore:
    root: Path
    samples: dict[str, RawSample]  # by sample_id
    order: list[str]  # sample ids in store order (shard by shard)
    mask_token_id: int
    vocab_size: int
    target_dir: Path  # the target the store was extracted from


def extract_store(root: Path, target: Path, num_records: int, *, seed: int, samples_per_shard: int,
                  logprob_dtype: str) -> TinyStore:
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract

    data = write_chat_jsonl(root.parent / f"{root.name}.jsonl", num_records, seed=seed)
    run_extract(ExtractConfig(data=(str(data),), target=str(target), out=str(root), backend="hf", topk=TOPK,
                              samples_per_shard=samples_per_shard, device="cpu", logprob_dtype=logprob_dtype,
                              max_seq_len=512), echo=lambda _: None, progress=False)
    return read_raw_store(root, target)


def read_raw_store(root: Path, target_dir: Path) -> TinyStore:
    """Every sample with its tensor rows, straight from the files."""
    import json

    import pyarrow.parquet as pq
    from safetensors import safe_open

    manifest = json.loads((root / "manifest.json").read_text())
    samples, order = {}, []
    for shard in manifest["shards"]:
        rows = pq.read_table(root / shard["parquet"]).to_pylist()
        with safe_open(root / shard["safetensors"], framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for row in rows:
            a, n = row["token_offset"], row["num_tokens"]
            samples[row["sample_id"]] = RawSample(
                row["sample_id"], row["input_ids"], [int(v) for v in row["loss_mask"]], shard["index"],
                tensors["aux_hidden"][a:a + n], tensors["topk_ids"][a:a + n], tensors["topk_logprobs"][a:a + n])
            order.append(row["sample_id"])
    return TinyStore(root=root, samples=samples, order=order, mask_token_id=manifest["mask_token_id"],
                     vocab_size=manifest["target"]["vocab_size"], target_dir=Path(target_dir))


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_llama) -> TinyStore:
    """36 chat records of the tiny Llama target in 8 shards of <= 5 samples (float16 log-probs)."""
    return extract_store(tmp_path_factory.mktemp("stores") / "a", tiny_llama, 36, seed=1, samples_per_shard=5,
                         logprob_dtype="float16")


@pytest.fixture(scope="session")
def tiny_store_b(tmp_path_factory, tiny_llama) -> TinyStore:
    """A second, smaller store (12 other records, 3 shards, float32 log-probs) for mixing tests."""
    return extract_store(tmp_path_factory.mktemp("stores") / "b", tiny_llama, 12, seed=2, samples_per_shard=4,
                         logprob_dtype="float32")
