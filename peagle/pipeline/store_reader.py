"""A shard store's samples in training coordinates (docs/store.md, docs/indexing.md): the training reader.

Everything that trains on or evaluates a store's samples reads them here: the training loader (its
shard reader and the byte ranges of a batch's aux rows), draft-vocab counting and offline evaluation.
The samples are those of the raw reader (:mod:`peagle.pipeline.raw_reader`, token index i, as stored),
shifted once, here: :func:`shift_columns` shifts a shard's columns, :func:`training_rows` says which
tensor rows a position reads, and :func:`shift_sample` builds one :class:`TrainingSample` from one
``RawSample`` through both.

**Training coordinates (docs/indexing.md).** A sample of tokens ``x_0 … x_{n−1}`` becomes T = n − 1
training positions p ∈ [0, n−2]. At position p:

* ``tokens[p] = x_{p+1}`` -- the depth-0 input token;
* ``aux[p]`` -- the depth-0 input state (the target's state after reading x_0 … x_p);
* ``topk[p+1]`` -- the target distribution of the element at p, which predicts x_{p+2};
* ``targets[p] = x_{p+2}`` (−1 at p = n−2: there is no x_n);
* ``supervised[p] = m[p] = loss_mask[p+2]`` (``m[n−2] = 0``).

Readers never add 1 or 2 again: the loader, vocab counting and offline evaluation all receive
these arrays. (Charged tokens are exactly ``targets[supervised]``: the x_i with ``loss_mask[i] = 1``
and i ≥ 2.)

The aux rows stay in their stored encoding (:class:`StoredAux`, :mod:`peagle.pipeline.shard_tensors`);
``TrainingSample.aux_TAH`` are the states themselves (bf16), dequantised where needed, and
:class:`AuxSource` reads a batch's aux rows from their byte ranges.

Shape letters: n a sample's tokens, T = n − 1 training positions, A aux layers, H hidden size,
k stored top-k.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from peagle.pipeline.aux_rows import AuxSource, ByteRange, StoredAux
from peagle.pipeline.raw_reader import RawColumns, RawSample, raw_sample, read_raw_columns
from peagle.pipeline.safetensors_file import MappedFile, TensorEntry
from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.shard_tensors import check_rows, map_shard_tensors, stored_aux
from peagle.pipeline.split import is_heldout
from peagle.pipeline.store import Store, shard_file
from peagle.schemas import store as S
from peagle.schemas.errors import UserError

# --------------------------------------------------------------------------------------------------
# Training coordinates


@dataclass(frozen=True)
class ShardColumns:
    """A shard's Parquet columns in training coordinates, flat over its samples (module docstring).

    Sample i's positions are ``starts[i]:starts[i+1]`` of ``tokens``, ``targets``, ``supervised``.
    """

    sample_ids: list[str]
    starts: np.ndarray  # int64 [num_samples + 1]
    tokens: np.ndarray  # int64: x_{p+1}
    targets: np.ndarray  # int64: x_{p+2}, −1 at a sample's last position
    supervised: np.ndarray  # bool: m[p] = loss_mask[p+2]
    first_tokens: np.ndarray  # int64 [num_samples]: x_0
    token_offset: np.ndarray  # int64 [num_samples]: the sample's row 0 in the shard tensors

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    def num_positions(self, row: int) -> int:
        return int(self.starts[row + 1] - self.starts[row])


def shift_columns(raw: RawColumns) -> ShardColumns:
    """A shard's raw columns (token index i) -> training coordinates.

    This is the index shift of docs/indexing.md (module docstring), the only place it is written for
    the columns (:func:`training_rows` is its tensor rows).
    """
    offsets, lengths = raw.offsets, np.diff(raw.offsets)
    if lengths.size and int(lengths.min()) < 1:
        raise UserError("a store sample has no token")
    ids, mask = raw.input_ids, raw.loss_mask
    pos = np.arange(ids.size, dtype=np.int64) - np.repeat(offsets[:-1], lengths)  # index i inside the sample
    is_last = pos == np.repeat(lengths - 1, lengths)
    # Position p of a sample is its raw index i = p + 1: token x_{p+1}; x_{p+2} and loss_mask[p+2]
    # sit at the next raw index, which belongs to the same sample unless i is the sample's last.
    j = np.nonzero(pos >= 1)[0]
    nxt = np.minimum(j + 1, max(ids.size - 1, 0))
    has_next = ~is_last[j]
    return ShardColumns(
        sample_ids=list(raw.sample_ids),
        starts=offsets - np.arange(offsets.size, dtype=np.int64),  # n_i − 1 positions per sample
        tokens=ids[j],
        targets=np.where(has_next, ids[nxt], -1),
        supervised=has_next & mask[nxt],
        first_tokens=ids[offsets[:-1]],
        token_offset=raw.token_offset,
    )


def training_rows(token_offset: int, num_positions: int) -> tuple[slice, slice]:
    """(aux rows, top-k rows) of the shard tensors that a sample's T positions read, for a sample whose
    raw rows begin at ``token_offset``: ``aux[p]`` is raw row p and ``topk[p]`` raw row p + 1
    (docs/indexing.md), so aux row n − 1 and top-k row 0 are never read."""
    return (slice(token_offset, token_offset + num_positions),
            slice(token_offset + 1, token_offset + 1 + num_positions))


def read_num_positions(store: Store, index: int) -> tuple[list[str], np.ndarray]:
    """(sample ids, training positions n − 1 per sample) of shard ``index``: two small Parquet columns,
    all an epoch plan needs."""
    table = read_shard_rows(store, index, ["sample_id", "num_tokens"])
    return table.column("sample_id").to_pylist(), table.column("num_tokens").to_numpy().astype(np.int64) - 1


def read_columns(store: Store, index: int) -> ShardColumns:
    """Shard ``index``'s samples in training coordinates (Parquet only; no tensor is read).

    Raises:
        UserError: when a row's ``input_ids`` and ``loss_mask`` differ in length.
    """
    return shift_columns(read_raw_columns(store, index))


@dataclass(frozen=True, kw_only=True)
class TrainingSample:
    """One store sample in training coordinates: T = n − 1 positions p, every array indexed by p.

    ``aux`` and ``topk_*_Tk`` may be views into a memory-mapped shard: nothing is copied (or
    dequantised) until someone asks for ``aux_TAH`` or writes them elsewhere.
    """

    sample_id: str
    first_token: int  # x_0 (never an input or a target of the draft; prompts start with it)
    tokens_T: Tensor  # int64: x_{p+1}
    targets_T: Tensor  # int64: x_{p+2}, −1 at T−1
    supervised_T: Tensor  # bool: m[p] = loss_mask[p+2]
    aux: StoredAux  # aux[p], as stored
    topk_ids_Tk: Tensor  # int32: topk[p+1], the distribution of x_{p+2}
    topk_logprobs_Tk: Tensor  # float16/32: topk[p+1]

    @property
    def aux_TAH(self) -> Tensor:
        """aux[p]: the states (bf16), dequantised for an fp8 store."""
        return self.aux.states()

    @property
    def num_positions(self) -> int:
        return int(self.tokens_T.numel())

    @property
    def input_ids_n(self) -> Tensor:
        """The sample's tokens x_0 … x_{n−1}."""
        return torch.cat([torch.tensor([self.first_token], dtype=torch.long), self.tokens_T])

    def context_before_first_target(self) -> list[int] | None:
        """x_0 … x_{p+1} for the first supervised p: the conversation up to the first token the draft is
        charged for (a prompt whose continuation is what training supervises); None if nothing is."""
        supervised = self.supervised_T.nonzero().flatten()
        if not supervised.numel():
            return None
        return self.input_ids_n[: int(supervised[0]) + 2].tolist()


def _training_sample(columns: ShardColumns, row: int, aux: StoredAux, topk_ids: Tensor,
                     topk_logprobs: Tensor) -> TrainingSample:
    a, b = int(columns.starts[row]), int(columns.starts[row + 1])
    aux_rows, topk_rows = training_rows(int(columns.token_offset[row]), b - a)
    assert topk_rows.stop <= aux.num_rows, "token_offset past the shard's tensors"
    return TrainingSample(
        sample_id=columns.sample_ids[row],
        first_token=int(columns.first_tokens[row]),
        tokens_T=torch.from_numpy(columns.tokens[a:b]),
        targets_T=torch.from_numpy(columns.targets[a:b]),
        supervised_T=torch.from_numpy(columns.supervised[a:b]),
        aux=aux[aux_rows],
        topk_ids_Tk=topk_ids[topk_rows],
        topk_logprobs_Tk=topk_logprobs[topk_rows],
    )


def sample_of(columns: ShardColumns, row: int, tensors: dict[str, Tensor]) -> TrainingSample:
    """Sample ``row`` of a shard: its columns' slices and (views of) its tensor rows."""
    return _training_sample(columns, row, stored_aux(tensors), tensors[S.TOPK_IDS], tensors[S.TOPK_LOGPROBS])


def shift_sample(raw: RawSample) -> TrainingSample:
    """One raw sample (token index i) in training coordinates: the same shift as a shard's."""
    return _training_sample(shift_columns(raw.columns()), 0, raw.aux, raw.topk_ids_nk, raw.topk_logprobs_nk)


def training_sample(sample_id: str, input_ids_n: Tensor, loss_mask_n: Tensor, aux_nAH: Tensor,
                    topk_ids_nk: Tensor, topk_logprobs_nk: Tensor, aux_scale_nA: Tensor | None = None) -> TrainingSample:
    """One sample's raw rows (n tokens, as stored) in training coordinates (:func:`shift_sample`)."""
    n = int(torch.as_tensor(input_ids_n).numel())
    assert n >= 2 and aux_nAH.shape[0] == n and topk_ids_nk.shape[0] == n, "sample rows disagree"
    tensors = {S.AUX_HIDDEN: aux_nAH, S.TOPK_IDS: topk_ids_nk, S.TOPK_LOGPROBS: topk_logprobs_nk}
    if aux_scale_nA is not None:
        tensors[S.AUX_SCALE] = aux_scale_nA
    return shift_sample(raw_sample(sample_id, torch.as_tensor(input_ids_n).numpy(),
                                   torch.as_tensor(loss_mask_n).numpy(), tensors))


# --------------------------------------------------------------------------------------------------
# Readers


class ShardReader:
    """Samples of several opened stores by (store, shard position, row), with per-shard LRU caches of the
    columns (small) and of the tensor mappings (one per DataLoader worker: each maps what it reads).

    Before it hands out a sample, or tells the trainer where the sample's aux rows are, it checks the
    content of the tensor blocks those rows lie in (``shard_tensors.check_rows``): the check is spread
    over the batches that read a shard, and a block changed since its commit never reaches a step."""

    def __init__(self, stores: list[Store], capacity: int):
        self.stores, self.capacity = stores, capacity
        self._columns: OrderedDict[tuple[int, int], ShardColumns] = OrderedDict()
        self._tensors: OrderedDict[tuple[int, int], MappedFile] = OrderedDict()
        self._paths: dict[tuple[int, int], str] = {}

    def _cached(self, cache: OrderedDict, key: tuple[int, int], load: Callable[[], Any]) -> Any:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        value = cache[key] = load()
        while len(cache) > self.capacity:
            cache.popitem(last=False)
        return value

    def columns(self, store: int, shard: int) -> ShardColumns:
        index = self.stores[store].shards[shard].index
        return self._cached(self._columns, (store, shard), lambda: read_columns(self.stores[store], index))

    def tensors(self, store: int, shard: int) -> MappedFile:
        """The shard's tensor file, mapped (its content is checked by the rows a sample reads)."""
        index = self.stores[store].shards[shard].index
        return self._cached(self._tensors, (store, shard), lambda: map_shard_tensors(self.stores[store], index))

    def sample(self, store: int, shard: int, row: int) -> TrainingSample:
        index = self.stores[store].shards[shard].index
        return checked_sample(self.stores[store], index, self.columns(store, shard), row, self.tensors(store, shard))

    def aux_read(self, store: int, shard: int, row: int) -> tuple[ByteRange, ByteRange | None]:
        """Where the sample's T aux rows ``aux[0 … n−2]`` are: (absolute path, byte offset, byte count)
        of the stored rows, and of their scales in an fp8 store (else None); their content checked."""
        mapped = self.tensors(store, shard)
        aux_rows = _check_sample_rows(self.stores[store], self.stores[store].shards[shard].index,
                                      self.columns(store, shard), row, mapped, topk=False)
        entries = mapped.entries
        if (store, shard) not in self._paths:
            self._paths[(store, shard)] = str(shard_file(self.stores[store].root, self.stores[store].shards[shard],
                                                         "safetensors").resolve())
        path = self._paths[(store, shard)]

        def rows(entry: TensorEntry) -> ByteRange:
            return path, entry.offset + aux_rows.start * entry.row_bytes, (aux_rows.stop - aux_rows.start) * entry.row_bytes

        return rows(entries[S.AUX_HIDDEN]), rows(entries[S.AUX_SCALE]) if S.AUX_SCALE in entries else None


def iter_training_samples(store: Store, *, heldout_fraction: float | None = None,
                          max_samples: int | None = None) -> Iterator[TrainingSample]:
    """A store's samples in shard order; with ``heldout_fraction`` only the held-out ones
    (``peagle.pipeline.split``), at most ``max_samples``. The content of the rows of each sample is
    checked as it is handed out (not of whole shards: evaluation reads a few samples of each)."""
    yielded = 0
    for record in store.shards:
        columns, mapped = read_columns(store, record.index), None
        for row, sample_id in enumerate(columns.sample_ids):
            if heldout_fraction is not None and not is_heldout(sample_id, heldout_fraction):
                continue
            if max_samples is not None and yielded >= max_samples:
                return
            mapped = mapped or map_shard_tensors(store, record.index)
            yield checked_sample(store, record.index, columns, row, mapped)
            yielded += 1


def checked_sample(store: Store, index: int, columns: ShardColumns, row: int, mapped: MappedFile) -> TrainingSample:
    """Sample ``row`` of shard ``index`` (its tensor file ``mapped``), once the content of every row it
    exposes is checked (``shard_tensors.check_rows``: the blocks of its aux rows, fp8 scales and top-k rows).

    Raises:
        UserError: those blocks differ from the commit record.
    """
    _check_sample_rows(store, index, columns, row, mapped, topk=True)
    return sample_of(columns, row, mapped.tensors)


def _check_sample_rows(store: Store, index: int, columns: ShardColumns, row: int, mapped: MappedFile, *,
                       topk: bool) -> slice:
    """Check the sample's aux rows (and scales) and, with ``topk``, its top-k rows; returns its aux rows."""
    aux_rows, topk_rows = training_rows(int(columns.token_offset[row]), columns.num_positions(row))
    check_rows(store, index, mapped, aux_rows, (S.AUX_HIDDEN, S.AUX_SCALE))
    if topk:
        check_rows(store, index, mapped, topk_rows, (S.TOPK_IDS, S.TOPK_LOGPROBS))
    return aux_rows


def iter_shard_columns(store: Store) -> Iterator[tuple[int, ShardColumns]]:
    """(shard index, columns) of every committed shard, in order (Parquet only)."""
    for record in store.shards:
        yield record.index, read_columns(store, record.index)


__all__ = [
    "AuxSource", "ByteRange", "ShardColumns", "ShardReader", "StoredAux", "TrainingSample", "checked_sample",
    "iter_shard_columns",
    "iter_training_samples", "read_columns", "read_num_positions", "sample_of", "shift_columns", "shift_sample",
    "training_rows", "training_sample",
]
