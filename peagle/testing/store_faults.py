"""Faults planted in a real store the way inference-engine bugs put them there, for ``peagle store check``.

Each fault is written the way a buggy extractor would have written it: the shard's rows are edited,
re-encoded through the real encoder (``shard_tensors.encode_sample``, ``write_tensors``), and committed
through the real protocol (``shard_commit.write_and_commit_shard``) with fresh sizes, sha256, crc32 and
content statistics, so ``peagle store verify`` sees an intact store. (With ``keep_stats`` the old
statistics stay in the record: rows changed after their commit.)

* :func:`zero_sample_rows` -- one sample's aux rows all zero (a request whose states were never written);
* :func:`shift_shard_rows` -- every row of a shard one position early (row t holds row t+1: a dropped
  first row), aux and top-k alike;
* :func:`copy_sample_states` -- one sample's aux states are another sample's (stale state);
* :func:`claim_target` -- a store's recorded target identity replaced by another target's (a store made
  from other weights than it says);
* :func:`recommit` -- a shard's files, edited by hand, committed as they are now (as if the extractor had
  written them so);
* :func:`flip_byte` -- one bit of a committed file flipped, its size kept and its record not: what a
  disk, a network file system or a stray write does after the commit (the content check's case).

Shape letters: T rows of a shard, A aux layers, H hidden size, k top-k.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch

from peagle.pipeline.atomic import canonical_json
from peagle.pipeline.content_check import file_digests
from peagle.pipeline.raw_reader import RawColumns, RawShard, open_raw_shard, raw_sample
from peagle.pipeline.shard_commit import write_and_commit_shard
from peagle.pipeline.shard_stats import sample_rows, shard_stats
from peagle.pipeline.shard_tensors import encode_sample, stored_aux, write_tensors
from peagle.pipeline.shard_commit import commit_shard
from peagle.pipeline.store import open_store, rebuild_manifest
from peagle.schemas import store as S

Edit = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RawColumns], None]
"""edit(states_TAH, topk_ids_Tk, topk_logprobs_Tk, columns): change the shard's tensors in place; ``columns``
are its Parquet columns (``RawColumns.tensor_rows`` says which rows are a sample's)."""


def rewrite_shard(root: str | Path, index: int, edit: Edit, *, keep_stats: bool = False) -> S.ShardRecord:
    """Edit shard ``index``'s rows and commit them as the extractor would (module docstring)."""
    store = open_store(root)
    record = store.shard(index)
    shard = open_raw_shard(store, index)
    states_TAH = stored_aux(shard.tensors).states().clone()
    ids_Tk, lps_Tk = shard.tensors[S.TOPK_IDS].clone(), shard.tensors[S.TOPK_LOGPROBS].clone()
    edit(states_TAH, ids_Tk, lps_Tk, shard.columns)
    edited = RawShard(index, shard.columns, {S.AUX_HIDDEN: states_TAH, S.TOPK_IDS: ids_Tk, S.TOPK_LOGPROBS: lps_Tk})
    encoded, facts = [], []
    for sample in edited.samples():
        parts = encode_sample(sample.aux_nAH, sample.topk_ids_nk, sample.topk_logprobs_nk, store.settings)
        encoded.append(parts)
        facts.append(sample_rows(raw_sample(sample.sample_id, sample.input_ids_n, sample.loss_mask_n, parts)))
    stats = record.stats if keep_stats else shard_stats(facts, store.settings)
    return write_and_commit_shard(store.root, replace(record, stats=stats), write_rows=None,  # the rows stay
                                  write_tensors=lambda tmp: write_tensors(tmp, encoded, store.settings))


def _rows_of(columns: RawColumns, sample_id: str) -> slice:
    return columns.tensor_rows(columns.row_of(sample_id))


def zero_sample_rows(root: str | Path, index: int, sample_id: str, *, keep_stats: bool = False) -> S.ShardRecord:
    """Every aux row of one sample all zero."""
    def edit(states_TAH, ids_Tk, lps_Tk, columns):
        states_TAH[_rows_of(columns, sample_id)] = 0

    return rewrite_shard(root, index, edit, keep_stats=keep_stats)


def shift_shard_rows(root: str | Path, index: int) -> S.ShardRecord:
    """Row t of the shard holds what row t+1 held (the last row kept): every sample one position early."""
    def edit(states_TAH, ids_Tk, lps_Tk, columns):
        for t in (states_TAH, ids_Tk, lps_Tk):
            t[:-1] = t[1:].clone()

    return rewrite_shard(root, index, edit)


def shift_sample_rows(root: str | Path, index: int, sample_id: str) -> S.ShardRecord:
    """One sample's rows one position early (its row i holds its row i+1; the last row kept)."""
    def edit(states_TAH, ids_Tk, lps_Tk, columns):
        rows = _rows_of(columns, sample_id)
        for t in (states_TAH, ids_Tk, lps_Tk):
            t[rows.start:rows.stop - 1] = t[rows.start + 1:rows.stop].clone()

    return rewrite_shard(root, index, edit)


def copy_sample_states(root: str | Path, index: int, source_id: str, target_id: str) -> S.ShardRecord:
    """Sample ``target_id``'s aux rows are ``source_id``'s (as many as both have), both in shard ``index``."""
    def edit(states_TAH, ids_Tk, lps_Tk, columns):
        src, dst = _rows_of(columns, source_id), _rows_of(columns, target_id)
        n = min(src.stop - src.start, dst.stop - dst.start)
        states_TAH[dst.start:dst.start + n] = states_TAH[src.start:src.start + n].clone()

    return rewrite_shard(root, index, edit)


def recommit(root: str | Path, index: int) -> S.ShardRecord:
    """Commit shard ``index``'s two files as they are on disk now: fresh sizes, sha256 and crc32 (its
    statistics kept)."""
    root = Path(root)
    record = S.ShardRecord.from_dict(json.loads((root / S.commit_name(index)).read_text()))
    digests = {}
    for rel in (record.parquet, record.safetensors):
        sha256, crc32 = file_digests(root / rel)
        digests[rel] = ((root / rel).stat().st_size, sha256, crc32)
    (pq_size, pq_sha, pq_crc), (st_size, st_sha, st_crc) = digests[record.parquet], digests[record.safetensors]
    new = replace(record, parquet_bytes=pq_size, parquet_sha256=pq_sha, parquet_crc32=pq_crc,
                  safetensors_bytes=st_size, safetensors_sha256=st_sha, safetensors_crc32=st_crc)
    commit_shard(root, new)
    return new


def flip_byte(path: str | Path, *, at: float = 0.5, mask: int = 0x40) -> int:
    """XOR ``mask`` into the byte at fraction ``at`` of the file (0x40: a bf16 value's top exponent bit,
    at an even offset: the value jumps by ~2^64); returns the offset. The size stays."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    offset = min(int(len(data) * at), len(data) - 1)
    data[offset] ^= mask
    path.write_bytes(bytes(data))
    return offset


def claim_target(root: str | Path, identity: S.TargetIdentity) -> None:
    """Record ``identity`` as the store's target (store.json and the manifest), keeping its rows."""
    path = Path(root) / S.STORE_SETTINGS_FILE
    settings = json.loads(path.read_text())
    path.write_bytes(canonical_json({**settings, "target": asdict(identity)}))
    rebuild_manifest(root)


__all__ = ["claim_target", "copy_sample_states", "flip_byte", "recommit", "rewrite_shard", "shift_sample_rows",
           "shift_shard_rows", "zero_sample_rows"]
