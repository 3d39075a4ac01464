"""Reading a shard store's samples as stored, by token index i (docs/store.md, docs/indexing.md): the raw reader.

A sample of n tokens ``x_0 … x_{n−1}`` is one Parquet row and n rows of its shard's tensors, from row
``token_offset`` on. Every array here is indexed by the token index i, exactly as extract wrote it
(docs/indexing.md, "what the store holds"):

* ``input_ids[i] = x_i`` and ``loss_mask[i]`` (x_i is a token the draft should learn to write);
* ``aux[i]`` -- the target's states after reading x_0 … x_i;
* ``topk[i]`` -- the target's distribution of the *next* token x_{i+1} (:attr:`RawSample.next_tokens_n1`).

The store's own tools judge and rewrite samples in these coordinates (``store check``, ``store
convert``, the shard statistics, the planted faults of :mod:`peagle.testing.store_faults`). Training
reads the same samples shifted (:mod:`peagle.pipeline.store_reader`, whose columns and samples are
built from these: the shift is written there once). Opening a store (settings, commit records, size
and sha256 checks) and the content check of each file on its first read are :mod:`peagle.pipeline.store`;
the Parquet file is :mod:`peagle.pipeline.shard_parquet`, the tensor file :mod:`peagle.pipeline.shard_tensors`.

Shape letters: n a sample's tokens, A aux layers, H hidden size, k stored top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from peagle.pipeline.aux_rows import StoredAux
from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.shard_tensors import open_shard_tensors, stored_aux
from peagle.pipeline.store import Store
from peagle.schemas import store as S
from peagle.schemas.errors import UserError

_READ_COLUMNS = ["sample_id", "input_ids", "loss_mask", "token_offset"]


@dataclass(frozen=True)
class RawColumns:
    """A shard's Parquet columns as stored, flat over its samples: sample ``row``'s tokens are
    ``input_ids[offsets[row]:offsets[row+1]]``, its tensor rows begin at ``token_offset[row]``."""

    sample_ids: list[str]
    offsets: np.ndarray  # int64 [num_samples + 1]
    input_ids: np.ndarray  # int64: x_i
    loss_mask: np.ndarray  # bool: loss_mask[i]
    token_offset: np.ndarray  # int64 [num_samples]

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    def num_tokens(self, row: int) -> int:
        return int(self.offsets[row + 1] - self.offsets[row])

    def tensor_rows(self, row: int) -> slice:
        """Sample ``row``'s rows of the shard tensors (one per token)."""
        first = int(self.token_offset[row])
        return slice(first, first + self.num_tokens(row))

    def row_of(self, sample_id: str) -> int:
        return self.sample_ids.index(sample_id)


def _flat_list(array) -> tuple[np.ndarray, np.ndarray]:
    """Values and offsets (rebased to those values) of a pyarrow list array, possibly a slice."""
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    return values, offsets - offsets[0]


def read_raw_columns(store: Store, index: int) -> RawColumns:
    """Shard ``index``'s Parquet columns (no tensor is read).

    Raises:
        UserError: when a row's ``input_ids`` and ``loss_mask`` differ in length.
    """
    table = read_shard_rows(store, index, _READ_COLUMNS)
    ids, offsets = _flat_list(table.column("input_ids").combine_chunks())
    mask, mask_offsets = _flat_list(table.column("loss_mask").combine_chunks())
    if not np.array_equal(offsets, mask_offsets):
        raise UserError(f"store {store.root}: shard {index} has input_ids and loss_mask of different lengths "
                        "in some row")
    return RawColumns(sample_ids=table.column("sample_id").to_pylist(), offsets=offsets,
                      input_ids=ids.astype(np.int64), loss_mask=mask.astype(bool),
                      token_offset=table.column("token_offset").to_numpy().astype(np.int64))


@dataclass(frozen=True, kw_only=True)
class RawSample:
    """One store sample as stored: n tokens, every array indexed by token index i (module docstring).

    ``aux`` and ``topk_*_nk`` may be views into a memory-mapped shard: nothing is copied (or
    dequantised) until someone asks for ``aux_nAH`` or writes them elsewhere.
    """

    sample_id: str
    input_ids_n: Tensor  # int64: x_i
    loss_mask_n: Tensor  # bool: loss_mask[i]
    aux: StoredAux  # aux[i], as stored
    topk_ids_nk: Tensor  # int32: topk[i], the distribution of x_{i+1}
    topk_logprobs_nk: Tensor  # float16/32: topk[i]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_n.numel())

    @property
    def aux_nAH(self) -> Tensor:
        """aux[i]: the states (bf16), dequantised for an fp8 store."""
        return self.aux.states()

    @property
    def next_tokens_n1(self) -> Tensor:
        """x_{i+1} for i ∈ [0, n−2]: the token whose distribution ``topk[i]`` is."""
        return self.input_ids_n[1:]

    @property
    def next_supervised_n1(self) -> Tensor:
        """loss_mask[i+1] for i ∈ [0, n−2]: whether that next token is one the draft should write."""
        return self.loss_mask_n[1:]

    def columns(self) -> RawColumns:
        """This sample alone as a shard's columns (its tensor rows from 0)."""
        return RawColumns(sample_ids=[self.sample_id], offsets=np.array([0, self.num_tokens], dtype=np.int64),
                          input_ids=self.input_ids_n.numpy(), loss_mask=self.loss_mask_n.numpy(),
                          token_offset=np.zeros(1, dtype=np.int64))


def raw_sample(sample_id: str, input_ids, loss_mask, tensors: dict[str, Tensor]) -> RawSample:
    """One sample from its tokens, loss mask and tensor rows (``shard_tensors.encode_sample``'s output,
    or ``tensor_rows`` of a shard's tensors)."""
    return RawSample(sample_id=sample_id, input_ids_n=torch.as_tensor(np.asarray(input_ids, dtype=np.int64)),
                     loss_mask_n=torch.as_tensor(np.asarray(loss_mask).astype(bool)), aux=stored_aux(tensors),
                     topk_ids_nk=tensors[S.TOPK_IDS], topk_logprobs_nk=tensors[S.TOPK_LOGPROBS])


@dataclass(frozen=True)
class RawShard:
    """One shard's samples as stored: its Parquet columns and its (memory-mapped) tensors."""

    index: int
    columns: RawColumns
    tensors: dict[str, Tensor]

    @property
    def num_samples(self) -> int:
        return self.columns.num_samples

    def sample(self, row: int) -> RawSample:
        c = self.columns
        a, b, rows = int(c.offsets[row]), int(c.offsets[row + 1]), c.tensor_rows(row)
        assert rows.stop <= self.tensors[S.AUX_HIDDEN].shape[0], "token_offset past the shard's tensors"
        return raw_sample(c.sample_ids[row], c.input_ids[a:b], c.loss_mask[a:b],
                          {name: t[rows] for name, t in self.tensors.items()})

    def samples(self) -> Iterator[RawSample]:
        """The shard's samples in row order."""
        return (self.sample(row) for row in range(self.num_samples))


def open_raw_shard(store: Store, index: int) -> RawShard:
    """Shard ``index`` of an opened store: its columns read, its tensors mapped."""
    return RawShard(index, read_raw_columns(store, index), open_shard_tensors(store, index))


def iter_raw_shards(store: Store) -> Iterator[RawShard]:
    """Every committed shard, in order (one mapped at a time while the caller lets go of the last)."""
    for record in store.shards:
        yield open_raw_shard(store, record.index)


__all__ = ["RawColumns", "RawSample", "RawShard", "iter_raw_shards", "open_raw_shard", "raw_sample",
           "read_raw_columns"]
