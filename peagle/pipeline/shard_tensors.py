"""A shard's tensor file (docs/store.md): its layout, one sample's rows encoded as stored, the file
written and mapped. **The layout is known here only.**

:func:`tensor_layout` says which tensors a shard file holds, with shape and dtype;
:func:`raw_bytes_per_token` is its size per token (extract's plan, ``store info``);
:func:`encode_sample` turns a sample's aux states and top-k into exactly those tensors (extract's
writer, ``store convert``), :func:`write_tensors` streams a shard of them into one file (through
:mod:`peagle.pipeline.safetensors_file`, the one parser and writer of the header), and
:func:`open_shard_tensors` maps a committed shard's tensors without reading them (its content checked
whole: for readers of every row), :func:`map_shard_tensors` with nothing checked, for a reader that
checks the rows it reads (:func:`check_rows`: the training reader). A change of the aux
representation (dtype, a scale tensor) lands in this file.

**Two encodings of the aux states** (``StoreSettings.hidden_dtype``): bf16 rows, or fp8 rows
(``float8_e4m3fn`` codes plus an ``aux_scale [T, A]`` float32 tensor, :mod:`peagle.pipeline.fp8`).
Readers get them as :class:`StoredAux` (:func:`stored_aux`: what the file holds);
``StoredAux.states()`` are the states themselves (bf16), dequantised where needed.

Shape letters: T rows (tokens) of a shard or a sample, A aux layers, H hidden size, k stored top-k.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import torch
from torch import Tensor

from peagle.pipeline import fp8
from peagle.pipeline.aux_rows import StoredAux
from peagle.pipeline.safetensors_file import MappedFile, encode_header, map_file, map_tensors
from peagle.pipeline.store import Store, damaged, shard_file
from peagle.schemas import store as S

AUX_DTYPES = {S.HIDDEN_BF16: torch.bfloat16, S.HIDDEN_FP8: fp8.FP8_DTYPE}
"""dtype of ``aux_hidden`` rows on disk, by ``StoreSettings.hidden_dtype``."""
TOPK_IDS_DTYPE = torch.int32
LOGPROB_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def tensor_layout(settings: S.StoreSettings, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of a shard holding ``num_tokens`` rows, in file order, with shape and dtype
    (``aux_scale`` only in fp8 stores)."""
    num_aux = len(settings.aux_layer_ids)
    layout = {S.AUX_HIDDEN: ((num_tokens, num_aux, settings.target.hidden_size), AUX_DTYPES[settings.hidden_dtype])}
    if settings.hidden_dtype == S.HIDDEN_FP8:
        layout[S.AUX_SCALE] = ((num_tokens, num_aux), fp8.SCALE_DTYPE)
    layout[S.TOPK_IDS] = ((num_tokens, settings.topk), TOPK_IDS_DTYPE)
    layout[S.TOPK_LOGPROBS] = ((num_tokens, settings.topk), LOGPROB_DTYPES[settings.logprob_dtype])
    return layout


def raw_bytes_per_token(settings: S.StoreSettings) -> int:
    """Tensor bytes per token, A·H·2 (bf16) or A·(H + 4) (fp8) + k·(4 + log-prob bytes): the store's
    size per token before Parquet, and the unit of extract's size estimate."""
    return sum(torch.Size(shape[1:]).numel() * dtype.itemsize for shape, dtype in tensor_layout(settings, 0).values())


def encode_sample(aux_TAH: Tensor, topk_ids_Tk: Tensor, topk_logprobs_Tk: Tensor,
                  settings: S.StoreSettings) -> dict[str, Tensor]:
    """One sample's tensors as the store holds them (:func:`tensor_layout`, in file order).

    The aux states are rounded to bf16 first, also for fp8: an fp8 store is then exactly the
    conversion (``peagle store convert``) of the bf16 store of the same run, whichever backend
    computed it (the double rounding costs at most bf16's 2^-9 next to fp8's 2^-4; docs/fp8.md).
    """
    layout = tensor_layout(settings, 0)
    logprob_dtype = layout[S.TOPK_LOGPROBS][1]
    low = torch.finfo(logprob_dtype).min  # a log-prob below fp16's range is zero probability anyway
    states_TAH = aux_TAH.to(torch.bfloat16)
    parts = {S.TOPK_IDS: topk_ids_Tk.to(layout[S.TOPK_IDS][1]),
             S.TOPK_LOGPROBS: topk_logprobs_Tk.clamp(min=low).to(logprob_dtype)}
    if settings.hidden_dtype == S.HIDDEN_FP8:
        parts[S.AUX_HIDDEN], parts[S.AUX_SCALE] = fp8.quantize(states_TAH)
    else:
        parts[S.AUX_HIDDEN] = states_TAH
    return {name: parts[name].contiguous() for name in layout}


def write_tensors(path: str | Path, samples: list[dict[str, Tensor]], settings: S.StoreSettings) -> None:
    """A shard's tensors (each sample's from :func:`encode_sample`) in the store's layout, streamed
    sample by sample into one safetensors file (no concatenated copy)."""
    assert sys.byteorder == "little", "safetensors is little-endian; raw tensor bytes are written as-is"
    layout = tensor_layout(settings, sum(parts[S.AUX_HIDDEN].shape[0] for parts in samples))
    with open(path, "wb") as f:
        f.write(encode_header(layout))
        for name, (shape, dtype) in layout.items():
            for parts in samples:
                t = parts[name]
                assert t.shape[1:] == shape[1:] and t.dtype == dtype, (name, t.shape, t.dtype, shape, dtype)
                f.write(memoryview(t.view(torch.uint8).numpy()))


def open_shard_tensors(store: Store, index: int) -> dict[str, Tensor]:
    """Shard ``index``'s tensors, memory-mapped, for a reader of all its rows: the whole file's content
    checked against its commit record (``Store.check_content``, on this mapping: the pass pages the
    file in for the reads that follow); one line naming the file if it does not parse."""
    rel = store.shard(index).safetensors
    path = shard_file(store.root, store.shard(index), "safetensors")
    try:
        return map_tensors(path, check=lambda data: store.check_content(index, rel, data))
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as err:
        raise damaged(path, err) from err


def map_shard_tensors(store: Store, index: int) -> MappedFile:
    """Shard ``index``'s tensor file, memory-mapped, nothing read or checked: for a reader that checks
    the rows it reads, as it reads them (:func:`check_rows`); one line naming the file if it does not parse."""
    path = shard_file(store.root, store.shard(index), "safetensors")
    try:
        return map_file(path)
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as err:
        raise damaged(path, err) from err


def check_rows(store: Store, index: int, mapped: MappedFile, rows: slice, names: tuple[str, ...]) -> None:
    """Check the content of rows ``rows`` of the named tensors (those the file holds) of shard ``index``
    (``Store.check_content``: the blocks they lie in, each once per opened store).

    Raises:
        UserError: the blocks differ from the commit record.
    """
    entries = [mapped.entries[name] for name in names if name in mapped.entries]
    ranges = [(e.offset + rows.start * e.row_bytes, e.offset + rows.stop * e.row_bytes) for e in entries]
    store.check_content(index, store.shard(index).safetensors, mapped.data, ranges)


def stored_aux(tensors: dict[str, Tensor]) -> StoredAux:
    """The aux rows of a shard's (mapped, or just encoded) tensors, in whichever encoding they hold."""
    return StoredAux(tensors[S.AUX_HIDDEN], tensors.get(S.AUX_SCALE))


__all__ = ["AUX_DTYPES", "LOGPROB_DTYPES", "TOPK_IDS_DTYPE", "check_rows", "encode_sample", "map_shard_tensors",
           "open_shard_tensors", "raw_bytes_per_token", "stored_aux", "tensor_layout", "write_tensors"]
