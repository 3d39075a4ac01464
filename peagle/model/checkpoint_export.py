"""A training checkpoint as a speculators export directory: `peagle export`, and `peagle eval` on a run.

Both stages turn checkpoints into exports (eval measures exactly what vLLM serves, so it exports a
run first); stages never import each other, so the conversion lives here. The checkpoint is read
through its format (peagle/pipeline/checkpoint_files.py: sizes and sha256 of the parts read are
checked first), the directory is written by the format's one home
(peagle/model/speculators_format.py).

The export's ``peagle`` section records where the draft came from: the provenance training
recorded in the checkpoint (peagle version, git revision, host of the *training* process), the
checkpoint and its step, the store manifest hash, the trained depths, the draft and run configs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import torch

from peagle.model.speculators_format import write_export
from peagle.model.finite import describe, non_finite_tensors
from peagle.model.target.directory import CONFIG_FILE, read_config_json
from peagle.pipeline.checkpoint_files import DraftCheckpoint, read_draft_checkpoint
from peagle.schemas.errors import UserError
from peagle.schemas.speculative_schedule import SCHEDULE_KEY, Schedule, check_schedule


def export_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *, verifier_name: str | None = None,
                      speculative_tokens: int | None = None, dtype: str = "float32",
                      speculative_schedule: Schedule | None = None, k_flag: str = "--speculative-tokens",
                      max_file_bytes: int | None = None) -> Path:
    """Export the checkpoint ``source`` names (a run's newest valid one, or one checkpoint) to ``out``.

    ``verifier_name`` defaults to the target path training used, ``speculative_tokens`` to the trained
    number of depths, which bound it for a P-EAGLE draft (:func:`check_served_k`).
    ``speculative_schedule`` (a K per batch size, peagle/schemas/speculative_schedule.py) goes into the
    ``peagle`` section, checked against K and the drafting method. ``k_flag``: the flag that gave K,
    as an error line names it. ``max_file_bytes``: weights larger than that are written as shards.

    Raises:
        UserError: no usable checkpoint, a default that the checkpoint cannot supply, a K or schedule
            the draft cannot serve, or an ``out`` that holds something other than an export.
    """
    ckpt = read_draft_checkpoint(source)
    bad = non_finite_tensors(ckpt.state_dict)
    if bad:  # `peagle eval RUN_DIR` exports through here too; `peagle export` refused earlier, with a hint
        raise UserError(f"checkpoint {source} holds non-finite weights (NaN or inf) in {describe(bad)}; "
                        "a draft exported from it would draft nothing useful")
    target = ckpt.train_config.get("target")
    verifier = verifier_name or (str(Path(target).resolve()) if target else None)
    if not verifier:
        raise UserError("the checkpoint records no target path: pass --verifier-name")
    trained_depths = ckpt.train_config.get("num_depths")
    k = speculative_tokens or trained_depths
    if k is None:
        raise UserError("the checkpoint records no num_depths: pass --speculative-tokens")
    check_served_k(int(k), trained_depths, ckpt.draft_config.method, flag=k_flag)
    provenance = export_provenance(ckpt)
    if speculative_schedule is not None:
        provenance[SCHEDULE_KEY] = check_schedule(speculative_schedule, speculative_tokens=int(k),
                                                  parallel=ckpt.draft_config.method == "peagle",
                                                  where="--speculative-schedule")
    return write_export(ckpt.state_dict, ckpt.draft_config, out, verifier_name=verifier,
                        verifier_architectures=verifier_architectures(target, verifier), speculative_tokens=int(k),
                        dtype=getattr(torch, dtype), provenance=provenance, max_file_bytes=max_file_bytes)


def check_served_k(k: int, trained_depths: int | None, method: str, *, flag: str) -> None:
    """A K a draft trained at ``trained_depths`` can be served at: up to them for P-EAGLE, any for EAGLE-3.

    Why the two differ: a P-EAGLE draft proposes depth d from the d-th mask slot of one forward, and
    training (COD) only ever built mask slots up to depth ``num_depths - 1``: a deeper slot is a
    position the draft never learned to read. EAGLE-3 proposes depth d by running the same forward
    once more on its own previous hidden state (peagle/model/sequential.py, vLLM's eagle3 proposer),
    the step training unrolled ``num_depths`` times: one more is the same computation, only less
    often accepted, which is how EAGLE-3 drafts are served past their training-time-test steps.
    A draft that records no trained depths (another tool's export) is not bounded.

    Raises:
        UserError: a P-EAGLE K above its trained depths, in one line.
    """
    if trained_depths is None or k <= trained_depths:
        return
    if method == "peagle":
        raise UserError(f"{flag} {k}: this P-EAGLE draft was trained at {trained_depths} depths, so it serves K = 1 "
                        f"to {trained_depths} (its mask slots past depth {trained_depths} were never trained); "
                        f"train with --num-depths {k} to serve K = {k}")
    print(f"peagle: warning: {flag} {k} exceeds the {trained_depths} steps this EAGLE-3 draft was trained to "
          "unroll; it drafts them the same way, less often accepted", file=sys.stderr)


def export_provenance(ckpt: DraftCheckpoint) -> dict[str, Any]:
    """The export's ``peagle`` section (module docstring). A checkpoint from before training recorded
    provenance gives None for what it lacks, never the exporting machine's facts."""
    return {
        "peagle_version": ckpt.provenance.get("peagle_version"),
        "git_revision": ckpt.provenance.get("git_revision"),
        "host": ckpt.provenance.get("host"),
        "checkpoint": str(ckpt.path.resolve()),
        "step": ckpt.step,
        "store_manifest_hash": ckpt.extra.get("store_manifest_hash"),
        "num_depths_trained": ckpt.train_config.get("num_depths"),
        "draft_config": ckpt.draft_config.to_dict(),
        "run_config": ckpt.train_config,
    }


def verifier_architectures(target: str | None, verifier_name: str) -> list[str]:
    """The verifier's ``architectures`` from a local target directory (the training target, else the name)."""
    for candidate in (target, verifier_name):
        if candidate and (Path(candidate) / CONFIG_FILE).is_file():
            with contextlib.suppress(UserError):
                return list(read_config_json(candidate).get("architectures") or [])
    return []
