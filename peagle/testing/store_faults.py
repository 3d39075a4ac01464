"""Faults planted in a real store the way inference-engine bugs put them there, for ``peagle store check``.

Each fault is written the way a buggy extractor would have written it: the shard's rows are edited,
re-encoded through the real writer (``encode_sample``, ``write_tensors``), and committed with fresh
sizes, sha256 and content statistics, so ``peagle store verify`` sees an intact store. (With
``keep_stats`` the old statistics stay in the record: rows changed after their commit.)

* :func:`zero_sample_rows` -- one sample's aux rows all zero (a request whose states were never written);
* :func:`shift_shard_rows` -- every row of a shard one position early (row t holds row t+1: a dropped
  first row), aux and top-k alike;
* :func:`copy_sample_states` -- one sample's aux states are another sample's (stale state);
* :func:`claim_target` -- a store's recorded target identity replaced by another target's (a store made
  from other weights than it says).

Shape letters: T rows of a shard, A aux layers, H hidden size, k top-k.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from peagle.pipeline.atomic import canonical_json
from peagle.pipeline.store import commit_shard, open_store, rebuild_manifest, write_shard_file
from peagle.pipeline.store_reader import open_shard_tensors, stored_aux
from peagle.schemas import store as S
from peagle.stages.extract.stats import sample_rows, shard_stats
from peagle.stages.extract.writer import encode_sample, write_tensors

Edit = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[dict]], None]
"""edit(states_TAH, topk_ids_Tk, topk_logprobs_Tk, rows): change the shard's tensors in place; ``rows``
are its Parquet rows (``sample_id``, ``token_offset``, ``num_tokens``, ...)."""


def rewrite_shard(root: str | Path, index: int, edit: Edit, *, keep_stats: bool = False) -> S.ShardRecord:
    """Edit shard ``index``'s rows and commit them as the extractor would (module docstring)."""
    store = open_store(root)
    record = store.shard(index)
    tensors = open_shard_tensors(store, index)
    states_TAH = stored_aux(tensors).states().clone()
    ids_Tk, lps_Tk = tensors[S.TOPK_IDS].clone(), tensors[S.TOPK_LOGPROBS].clone()
    rows = store.read_rows(index).to_pylist()
    edit(states_TAH, ids_Tk, lps_Tk, rows)
    encoded, facts = [], []
    for row in rows:
        a, n = row["token_offset"], row["num_tokens"]
        parts = encode_sample(states_TAH[a:a + n], ids_Tk[a:a + n], lps_Tk[a:a + n], store.settings)
        encoded.append(parts)
        facts.append(sample_rows(stored_aux(parts).states(), parts[S.TOPK_IDS], parts[S.TOPK_LOGPROBS],
                                 np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])))
    size, digest = write_shard_file(store.root, record.safetensors, lambda tmp: write_tensors(tmp, encoded, store.settings))
    new = replace(record, safetensors_bytes=size, safetensors_sha256=digest,
                  stats=record.stats if keep_stats else shard_stats(facts, store.settings))
    commit_shard(store.root, new)
    return new


def _row_of(rows: list[dict], sample_id: str) -> dict:
    return next(r for r in rows if r["sample_id"] == sample_id)


def zero_sample_rows(root: str | Path, index: int, sample_id: str, *, keep_stats: bool = False) -> S.ShardRecord:
    """Every aux row of one sample all zero."""
    def edit(states_TAH, ids_Tk, lps_Tk, rows):
        row = _row_of(rows, sample_id)
        states_TAH[row["token_offset"]:row["token_offset"] + row["num_tokens"]] = 0

    return rewrite_shard(root, index, edit, keep_stats=keep_stats)


def shift_shard_rows(root: str | Path, index: int) -> S.ShardRecord:
    """Row t of the shard holds what row t+1 held (the last row kept): every sample one position early."""
    def edit(states_TAH, ids_Tk, lps_Tk, rows):
        for t in (states_TAH, ids_Tk, lps_Tk):
            t[:-1] = t[1:].clone()

    return rewrite_shard(root, index, edit)


def shift_sample_rows(root: str | Path, index: int, sample_id: str) -> S.ShardRecord:
    """One sample's rows one position early (its row i holds its row i+1; the last row kept)."""
    def edit(states_TAH, ids_Tk, lps_Tk, rows):
        row = _row_of(rows, sample_id)
        a, n = row["token_offset"], row["num_tokens"]
        for t in (states_TAH, ids_Tk, lps_Tk):
            t[a:a + n - 1] = t[a + 1:a + n].clone()

    return rewrite_shard(root, index, edit)


def copy_sample_states(root: str | Path, index: int, source_id: str, target_id: str) -> S.ShardRecord:
    """Sample ``target_id``'s aux rows are ``source_id``'s (as many as both have), both in shard ``index``."""
    def edit(states_TAH, ids_Tk, lps_Tk, rows):
        src, dst = _row_of(rows, source_id), _row_of(rows, target_id)
        n = min(src["num_tokens"], dst["num_tokens"])
        states_TAH[dst["token_offset"]:dst["token_offset"] + n] = \
            states_TAH[src["token_offset"]:src["token_offset"] + n].clone()

    return rewrite_shard(root, index, edit)


def claim_target(root: str | Path, identity: S.TargetIdentity) -> None:
    """Record ``identity`` as the store's target (store.json and the manifest), keeping its rows."""
    path = Path(root) / S.STORE_SETTINGS_FILE
    settings = json.loads(path.read_text())
    path.write_bytes(canonical_json({**settings, "target": asdict(identity)}))
    rebuild_manifest(root)


__all__ = ["claim_target", "copy_sample_states", "rewrite_shard", "shift_sample_rows", "shift_shard_rows",
           "zero_sample_rows"]
