"""`peagle export`: a training checkpoint -> a speculators 'peagle' directory vLLM serves (docs/draft-and-export.md).

The conversion is shared with `peagle eval` (which exports a run before measuring it), so it lives
below the stages: :func:`peagle.model.checkpoint_export.export_checkpoint` reads the checkpoint's
model and config parts (their sizes and sha256 checked against ``metadata.json`` first) and writes
``config.json`` + ``model.safetensors`` atomically through the format's one home,
:mod:`peagle.model.speculators_format`: a reader such as vLLM sees a whole export or none, and
re-exporting replaces an export whole.

A checkpoint whose weights are not all finite (NaN, inf) is refused before anything is written
(:func:`refuse_non_finite_checkpoint`): vLLM would serve it without a word, drafting nothing useful.

**The form that travels.** A draft trained with ``--no-train-embeddings`` holds a copy of the
target's embedding, most of a small draft's bytes (SmolLM2's 49,152 x 576 rows: 108 MiB of a 128 MiB
export). ``--without-target-embedding`` leaves it out and records its sha256
(:func:`~peagle.model.speculators_format.without_target_embedding`); such an export as SOURCE with
``--target`` gets the target's rows back, checked against that sha256
(:func:`~peagle.model.speculators_format.with_target_embedding`): how the drafts committed under
benchmarks/results/cpu/drafts/ are served.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from peagle.model.checkpoint_export import export_checkpoint
from peagle.model.finite import describe, non_finite_tensors, recorded_finite
from peagle.model.speculators_format import (EMBEDDING_RECORD, PROVENANCE_KEY, looks_like_export, read_export_config,
                                              with_target_embedding, without_target_embedding)
from peagle.pipeline.checkpoint_files import (checkpoint_step, list_checkpoints, read_checkpoint_part,
                                             read_draft_checkpoint, resolve_checkpoint)
from peagle.schemas.checkpoint import CHECKPOINTS_DIR, MODEL
from peagle.schemas.errors import UserError
from peagle.schemas.export_config import ExportConfig
from peagle.schemas.speculative_schedule import VLLM_KEY, Schedule, parse_schedule


def run_export(config: ExportConfig, *, echo: Callable[[str], None] = print) -> Path:
    """Export the checkpoint ``config.source`` to ``config.out`` (whole, or without the target's
    embedding), or make an export that travelled without it whole; returns the export directory.

    Raises:
        UserError: no usable checkpoint, non-finite weights, a travelling export without --target,
            another target, or what ``export_checkpoint`` refuses.
    """
    source, out = Path(config.source), Path(config.out)
    max_bytes = None if config.max_file_mib is None else int(config.max_file_mib * 2**20)
    if config.speculative_schedule and ((source / EMBEDDING_RECORD).is_file() or looks_like_export(source)):
        raise UserError(f"{source} is an export: --speculative-schedule is written when a checkpoint is exported "
                        "(peagle export RUN_DIR --speculative-schedule ...); serve this one with vLLM's "
                        "--speculative-config instead")
    if (source / EMBEDDING_RECORD).is_file():
        if config.target is None:
            raise UserError(f"{source} was written without the target's embedding ({EMBEDDING_RECORD}): "
                            "pass --target DIR, the target it was trained on, to make it whole")
        path = with_target_embedding(source, config.target, out)
        echo(f"restored {source} with {config.target}'s embedding -> {path}  (serve: vllm serve {path})")
        return path
    if looks_like_export(source):  # a damaged config.json is named (read_export_config), not taken for a checkpoint
        if not config.without_target_embedding:
            raise UserError(f"{source} is an export already; serve it as it is, or pass --without-target-embedding "
                            "to write the copy that travels")
        refuse_trained_embedding((read_export_config(source).get(PROVENANCE_KEY) or {}).get("run_config"), source)
        path = without_target_embedding(source, out, max_file_bytes=max_bytes)
        echo(f"wrote {path} without the target's embedding (whole again: peagle export {path} --target T --out DIR)")
        return path
    checkpoint = resolve_checkpoint(config.source)
    refuse_non_finite_checkpoint(checkpoint)
    schedule = parse_schedule(config.speculative_schedule) if config.speculative_schedule else None
    if not config.without_target_embedding:
        path = export_checkpoint(checkpoint, out, verifier_name=config.verifier_name,
                                 speculative_tokens=config.speculative_tokens, dtype=config.dtype,
                                 speculative_schedule=schedule, max_file_bytes=max_bytes)
        echo(f"exported {config.source} -> {path}  (serve: vllm serve {path}{serve_flags(schedule)})")
        return path
    refuse_trained_embedding(read_draft_checkpoint(checkpoint).train_config, checkpoint)
    # the whole export beside --out under a name a later run's clean-up knows (.OUT.tmp-PID-*), then stripped
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        whole = export_checkpoint(checkpoint, work / "whole", verifier_name=config.verifier_name,
                                  speculative_tokens=config.speculative_tokens, dtype=config.dtype,
                                  speculative_schedule=schedule)
        path = without_target_embedding(whole, out, max_file_bytes=max_bytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    echo(f"exported {config.source} -> {path} without the target's embedding "
         f"(whole again: peagle export {path} --target T --out DIR)")
    return path


def refuse_trained_embedding(run_config: dict | None, source: Path) -> None:
    """Refuse to leave out an embedding the draft trained: the target's rows put back in its place
    would be another draft. A run config that does not say trained it (the default before
    ``--no-train-embeddings`` existed).

    Raises:
        UserError: in one line.
    """
    if (run_config or {}).get("train_embeddings", True):
        raise UserError(f"{source} trained its embedding (its run had no --no-train-embeddings): it cannot "
                        "travel without it; export it whole")


def refuse_non_finite_checkpoint(checkpoint: Path) -> None:
    """Refuse a checkpoint whose model part holds a NaN or an infinity, naming the tensors and, where
    its run records one, the newest earlier checkpoint with finite weights.

    Raises:
        UserError: in one line.
    """
    names = non_finite_tensors(read_checkpoint_part(checkpoint, MODEL))
    if not names:
        return
    step = checkpoint_step(checkpoint)
    earlier = [p for p in list_checkpoints(checkpoint.parent.parent)
               if checkpoint.parent.name == CHECKPOINTS_DIR and checkpoint_step(p) < step and recorded_finite(p)]
    hint = f"export {earlier[-1]} instead" if earlier else "export an earlier checkpoint with finite weights"
    raise UserError(f"checkpoint {checkpoint} holds non-finite weights (NaN or inf) in {describe(names)}; "
                    f"vLLM would serve a draft that drafts nothing useful; {hint}")


def serve_flags(schedule: Schedule | None) -> str:
    """What `vllm serve EXPORT` needs besides the export to serve ``schedule``: vLLM reads no schedule
    from a speculators config.json (peagle/schemas/speculative_schedule.py)."""
    if schedule is None:
        return ""
    return f" --speculative-config '{json.dumps({VLLM_KEY: schedule}, separators=(',', ':'))}'"
