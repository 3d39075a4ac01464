"""`peagle store convert --store STORE --hidden-dtype fp8 --out NEW`: rewrite a store's aux states in another
encoding, shard by shard, resumably, under extract's commit protocol (``shard_commit.write_and_commit_shard``).

Each committed shard of STORE becomes the same shard of NEW: its Parquet file is copied byte for
byte, its samples (read through the raw reader) are re-encoded by the encoder extract writes with
(``shard_tensors.encode_sample``; so an fp8 store
converted from bf16 is byte-identical to one extracted with ``--hidden-dtype fp8`` from the same
run), its content statistics are computed from the new rows, and its commit record is the source's
with the new file sizes, sha256, crc32 and statistics. A shard of NEW exists once its commit record does:
a killed conversion re-run with the same command converts only what is missing, and converting
into a directory made with other settings is refused in one line (``init_store``).

The source shard's sha256 is checked before it is converted: a damaged shard must not come out
with a fresh, valid checksum. NEW gets STORE's input registrations, so ``peagle extract --out NEW``
continues it; draft vocabularies are not copied (``peagle vocab --store NEW`` rebuilds one in seconds,
and it records NEW's own manifest hash).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from peagle.pipeline.contained import inside
from peagle.pipeline.plan import read_registrations
from peagle.pipeline.raw_reader import open_raw_shard, raw_sample
from peagle.pipeline.shard_commit import write_and_commit_shard
from peagle.pipeline.shard_stats import sample_rows, shard_stats
from peagle.pipeline.shard_tensors import encode_sample, write_tensors
from peagle.pipeline.store import (Store, check_shards, init_store, list_commits, open_store, rebuild_manifest,
                                   remove_stale_store_temps, shard_file, write_bytes_atomic)
from peagle.schemas import store as S
from peagle.schemas.errors import UserError


@dataclass(kw_only=True)
class ConvertSummary:
    source: Path
    out: Path
    hidden_dtype: str
    converted: list[int] = field(default_factory=list)  # shard indices converted by this run
    already: int = 0  # shards NEW held before this run


def convert_shard(source: Store, record: S.ShardRecord, out: Path, settings: S.StoreSettings) -> S.ShardRecord:
    """Convert and commit one shard of ``source`` into ``out`` (whose settings are ``settings``)."""
    problems = check_shards(source.root, [record], verify=True)
    if problems:
        raise UserError(f"store {source.root} is damaged: {problems[0]}; not converting it (run "
                        f"`peagle store verify --store {source.root}`)")
    encoded, rows = [], []
    for sample in open_raw_shard(source, record.index).samples():
        parts = encode_sample(sample.aux_nAH, sample.topk_ids_nk, sample.topk_logprobs_nk, settings)
        encoded.append(parts)
        rows.append(sample_rows(raw_sample(sample.sample_id, sample.input_ids_n, sample.loss_mask_n, parts)))
    source_rows = shard_file(source.root, record, "parquet")
    # The sizes and checksums committed are the new files' (also for a source committed before checksums).
    return write_and_commit_shard(out, replace(record, stats=shard_stats(rows, settings)),
                                  write_rows=lambda tmp: shutil.copyfile(source_rows, tmp),
                                  write_tensors=lambda tmp: write_tensors(tmp, encoded, settings))


def convert_store(source_root: str | Path, out_root: str | Path, hidden_dtype: str, *,
                  echo: Callable[[str], None] = print, progress: bool | None = None) -> ConvertSummary:
    """Convert every committed shard of ``source_root`` that ``out_root`` does not hold yet.

    Raises:
        UserError: unknown encoding, the source already in it, ``out_root`` the source itself, a store
            made with other settings or holding shards of another store, a damaged source shard, a full disk.
    """
    from tqdm import tqdm

    if hidden_dtype not in S.HIDDEN_DTYPES:
        raise UserError(f"--hidden-dtype must be one of {'|'.join(S.HIDDEN_DTYPES)}, got {hidden_dtype!r}")
    source = open_store(source_root)
    out = Path(out_root)
    if out.resolve() == source.root.resolve():
        raise UserError(f"--out {out} is the store itself; convert into a new directory")
    if source.settings.hidden_dtype == hidden_dtype:
        raise UserError(f"store {source.root} holds {hidden_dtype} hidden states already; nothing to convert")
    settings = replace(source.settings, hidden_dtype=hidden_dtype)
    # A new NEW gets STORE's plan before its store.json (a kill between leaves no store, and this
    # command makes it whole); an existing one with other settings is refused.
    init_store(out, settings, plan=read_registrations(source.root))
    remove_stale_store_temps(out)
    for registration in sorted((source.root / S.INPUTS_DIR).glob("*.json")):
        rel = f"{S.INPUTS_DIR}/{registration.name}"
        if not inside(out, rel).exists():
            write_bytes_atomic(out, rel, inside(source.root, rel).read_bytes())
    sources = {r.index: r for r in source.shards}
    for record in list_commits(out):
        if record.index not in sources or record.parquet_sha256 != sources[record.index].parquet_sha256:
            raise UserError(f"{out} holds shard {S.shard_stem(record.index)} that is no conversion of {source.root}; "
                            "convert into a new directory")
    done = {r.index for r in list_commits(out)}
    summary = ConvertSummary(source=source.root, out=out, hidden_dtype=hidden_dtype,
                             already=sum(r.index in done for r in source.shards))
    pending = [r for r in source.shards if r.index not in done]
    echo(f"peagle store convert --store {source.root} ({source.settings.hidden_dtype}) -> {out} ({hidden_dtype}): "
         f"{len(source.shards)} shards, {summary.already} converted already, {len(pending)} to do")
    bar = tqdm(total=sum(r.num_tokens for r in pending), unit="tok", unit_scale=True, desc="convert",
               file=sys.stderr, disable=None if progress is None else not progress)
    try:
        for record in pending:
            convert_shard(source, record, out, settings)
            summary.converted.append(record.index)
            bar.update(record.num_tokens)
    finally:
        bar.close()
    rebuild_manifest(out)  # also after a run that found nothing to do: a killed one may have left it stale
    before = sum(r.safetensors_bytes + r.parquet_bytes for r in source.shards)
    after = sum(r.safetensors_bytes + r.parquet_bytes for r in list_commits(out))
    echo(f"converted {len(summary.converted)} shards; {after:,} bytes vs {before:,} in {source.root} "
         f"({after / before if before else 0:.3f}x)")
    if (source.root / S.VOCAB_DIR).is_dir():
        echo(f"note: draft vocabularies are not copied; build one with `peagle vocab --store {out} --draft-vocab-size N`")
    return summary


__all__ = ["ConvertSummary", "convert_shard", "convert_store"]
