"""Training checkpoints: Stateful parts under constant keys, committed by one directory rename.

The layout and names are the checkpoint contract (peagle/schemas/checkpoint.py); finding and
checking checkpoints is shared with export (peagle/pipeline/checkpoint_files.py). This module writes
them (torchtitan's layout, made crash-safe) and loads them back into a run.

A save writes every part into a temp directory ``.step-N.tmp-<pid>-<rand>``, writes
``metadata.json``, then commits the directory whole (``pipeline.atomic.atomic_dir``: fsync, rename
into place, fsync the parent): a reader sees a whole checkpoint or none. Loading checks every file's size and sha256 against ``metadata.json``; a
damaged newest checkpoint (a disk that lost data, a truncated copy) is skipped with a warning and
the one before it used.

Per-rank parts (data position, RNG) are gathered to rank 0, which writes everything; a resume on
another world size is refused (the data stream of each rank would change). Every rank calls
:meth:`Checkpointer.save` (gathering is a collective).

``metadata.json`` also records whether the model's weights are all finite (``weights_finite``):
rotation never deletes the newest checkpoint with finite weights, so a run whose weights went bad
keeps a good checkpoint to export or restart from, however many bad ones followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from peagle.model.finite import non_finite_tensors, recorded_finite
from peagle.pipeline.atomic import atomic_dir, pid_alive, remove_dir
from peagle.pipeline.checkpoint_files import checkpoint_problem, list_checkpoints, read_checkpoint_part
from peagle.pipeline.failpoints import failpoint
from peagle.schemas.checkpoint import (ALL_PARTS, CHECKPOINTS_DIR, CONFIG, DATALOADER, FORMAT_VERSION, LR_SCHEDULER,
                                       METADATA_FILE, MODEL, OPTIMIZER, PER_RANK_PARTS, RNG, SHARED_PARTS,
                                       TRAIN_STATE, WEIGHTS_FINITE_KEY, part_file, step_dir_name)
from peagle.schemas.errors import UserError
from peagle.stages.train.seeds import stable_seed

__all__ = [  # the part names are re-exported: the trainer builds its state dict under them
    "CONFIG", "DATALOADER", "LR_SCHEDULER", "MODEL", "OPTIMIZER", "PER_RANK_PARTS", "RNG", "SHARED_PARTS",
    "TRAIN_STATE", "Checkpointer", "load_checkpoint", "load_model_and_optimizer", "model_and_optimizer_state",
    "rank_seed", "rng_state", "seed_rngs", "set_rng_state",
]


# --------------------------------------------------------------------------------------------------
# RNG


def rng_state() -> dict[str, Any]:
    """Every RNG a step can draw from: torch (CPU and this rank's CUDA device), numpy, python."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": _python_state_to_plain(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def seed_rngs(seed: int) -> None:
    """Seed every RNG :func:`rng_state` saves (torch, numpy, python): a run is reproducible from its seed."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)  # numpy takes 32-bit seeds only
    random.seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s own draws once the draft is built: ranks that drew alike from one seed
    (the draft's initialisation must be the same everywhere) would otherwise draw the same noise
    (``--aux-noise``) on every rank, correlated where it is meant to be independent."""
    return stable_seed(int(seed), int(rank))


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _python_state_to_plain(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


# --------------------------------------------------------------------------------------------------
# Save


class Checkpointer:
    """One run's checkpoints: saves them (a collective), prunes old ones, and remembers which ones it
    has verified whole, so that pruning after every save does not read gigabytes of unchanged files
    again. The memory is this object's (a trainer holds one): another process, or another
    Checkpointer, hashes what it has not seen itself.
    """

    def __init__(self, run_dir: str | os.PathLike, *, keep: int):
        self.run_dir, self.keep = Path(run_dir), keep
        self._known_valid: set[tuple] = set()
        """File signatures (:func:`_signature`) of checkpoints this object wrote or hashed whole."""
        self._finite: dict[tuple, bool] = {}
        """Whether the weights are finite, by signature, for checkpoints that do not record it."""

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Commit ``state`` (every part of ``SHARED_PARTS + PER_RANK_PARTS``) as ``step-N``; keep the newest ``keep``.

        Collective under torch.distributed: per-rank parts are gathered to rank 0, which writes; the
        other ranks wait at a barrier until the checkpoint is committed. Returns the path on rank 0.
        """
        missing = [k for k in ALL_PARTS if k not in state]
        assert not missing, f"checkpoint state lacks {missing}"
        rank, world = _rank_world()
        gathered = {key: _gather_to_rank0(state[key], rank, world) for key in PER_RANK_PARTS}
        path = None
        if rank == 0:
            parts = {key: state[key] for key in SHARED_PARTS}
            for key, per_rank in gathered.items():
                parts[key] = {"world_size": world, **{f"rank_{i}": s for i, s in enumerate(per_rank)}}
            path = self._write_committed(step, parts)
            self.prune()
        if world > 1:
            dist.barrier()
        return path

    def _write_committed(self, step: int, parts: dict[str, Any]) -> Path:
        final = self.run_dir / CHECKPOINTS_DIR / step_dir_name(step)
        with atomic_dir(final) as tmp:  # a re-run that reached the same step again replaces it whole
            files = {}
            for key, obj in parts.items():
                name = part_file(key)
                with open(tmp / name, "wb") as f:
                    writer = _HashingWriter(f)
                    try:
                        torch.save(obj, writer)
                    except Exception:
                        # torch's zip writer turns a failed write into RuntimeError("unexpected pos"):
                        # re-raise the OSError underneath, so a full disk is told as one.
                        if writer.error is not None:
                            raise writer.error from None
                        raise
                    failpoint("train.checkpoint_write")
                    f.flush()
                    os.fsync(f.fileno())
                files[name] = {"bytes": writer.num_bytes, "sha256": writer.sha256.hexdigest()}
            meta = {"format_version": FORMAT_VERSION, "step": step, "parts": sorted(parts), "files": files,
                    WEIGHTS_FINITE_KEY: not non_finite_tensors(parts[MODEL])}
            with open(tmp / METADATA_FILE, "w") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
            failpoint("train.before_checkpoint_rename")
        failpoint("train.after_checkpoint_rename")
        self._known_valid.add(_signature(final))  # hashed while written
        return final

    def prune(self) -> None:
        """Delete every checkpoint older than the newest ``keep`` VALID ones, except the newest valid one
        with finite weights, and the temp and half-deleted directories a killed process left (its pid
        is in the name).

        Damaged checkpoints do not count towards ``keep``: a run restarted below damaged checkpoints of
        higher steps would otherwise delete each good checkpoint right after writing it. A damaged one
        goes once ``keep`` valid ones of higher steps exist. Checkpoints whose weights are not all
        finite count towards ``keep`` (they are what the run did), but the newest valid one whose
        weights are finite is never deleted: the last good weights outlive any run of bad ones.
        """
        root = self.run_dir / CHECKPOINTS_DIR
        num_valid, finite_kept = 0, False
        for path in reversed(list_checkpoints(self.run_dir)):
            if num_valid >= self.keep:
                if not finite_kept and self.is_valid(path) and self.weights_finite(path):
                    finite_kept = True  # the last good weights, older than the kept checkpoints
                    continue
                remove_dir(path)
            elif self.is_valid(path):
                num_valid += 1
                finite_kept = finite_kept or self.weights_finite(path)
        for marker in (".tmp-", ".deleted-"):  # half-written, or renamed away and half-deleted (remove_dir)
            for leftover in root.glob(f".step-*{marker}*"):
                with contextlib.suppress(ValueError, IndexError):
                    pid = int(leftover.name.split(marker)[1].split("-")[0])
                    if pid != os.getpid() and not pid_alive(pid):
                        shutil.rmtree(leftover, ignore_errors=True)

    def is_valid(self, path: Path) -> bool:
        """Whether every file of checkpoint ``path`` matches ``metadata.json`` (hashed once per signature)."""
        with contextlib.suppress(OSError):
            if _signature(path) in self._known_valid:
                return True
        if checkpoint_problem(path) is not None:
            return False
        with contextlib.suppress(OSError):
            self._known_valid.add(_signature(path))
        return True

    def weights_finite(self, path: Path) -> bool:
        """Whether a (valid) checkpoint's weights are all finite: as its metadata records it, else (a
        checkpoint of an older peagle) read from its model part, once per signature."""
        recorded = recorded_finite(path)
        if recorded is not None:
            return recorded
        signature = _signature(path)
        if signature not in self._finite:
            self._finite[signature] = not non_finite_tensors(read_checkpoint_part(path, MODEL))
        return self._finite[signature]


def _signature(path: Path) -> tuple:
    """(path, then name, inode, size, mtime of every file): any rewrite of a file changes it."""
    files = []
    for file in sorted(path.iterdir()):
        st = file.stat()
        files.append((file.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return (str(path), *files)


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (no second read of a big file).

    It keeps the first ``OSError`` of a write: torch.save reports it only as a RuntimeError.
    """

    def __init__(self, f: io.BufferedWriter):
        self.f, self.sha256, self.num_bytes = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.num_bytes += len(data)
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as err:
            self.error = self.error or err
            raise


def model_and_optimizer_state(draft: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The MODEL and OPTIMIZER parts: the unwrapped draft's full state dict (FSDP2: gathered full
    tensors) and its optimizer's, on the CPU."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {MODEL: get_model_state_dict(draft, options=options),
            OPTIMIZER: get_optimizer_state_dict(draft, optimizer, options=options)}


# --------------------------------------------------------------------------------------------------
# Load


def load_model_and_optimizer(draft: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Set the draft and its optimizer from a checkpoint's MODEL and OPTIMIZER parts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(draft, state[MODEL], options=options)
    set_optimizer_state_dict(draft, optimizer, state[OPTIMIZER], options=options)


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Every part of a checkpoint, per-rank parts reduced to this rank's entry.

    Raises:
        UserError: when the checkpoint was written by another world size.
    """
    path = Path(path)
    rank, world = _rank_world()
    state = {}
    for key in ALL_PARTS:
        state[key] = read_checkpoint_part(path, key, map_location=map_location)
    for key in PER_RANK_PARTS:
        saved_world = state[key]["world_size"]
        if saved_world != world:
            raise UserError(f"checkpoint {path} was written by {saved_world} processes, this run has {world}; "
                            "resume with the same number of processes (or use a new --out)")
        state[key] = state[key][f"rank_{rank}"]
    return state


# --------------------------------------------------------------------------------------------------


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_to_rank0(obj: Any, rank: int, world: int) -> list[Any] | None:
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
