"""Non-finite weights (NaN, ±inf): found in a state dict, an export file, or as a checkpoint records them.

A draft with one NaN weight drafts nothing useful and makes every later training step NaN, and
nothing downstream complains: vLLM serves it, a warm start trains on from it. So the places where
weights change hands refuse them in one line naming the tensors: ``peagle export`` (a checkpoint's
model part), ``peagle train --init-from`` (an export's ``model.safetensors``); and training
records, in each checkpoint's ``metadata.json``, whether its weights are all finite
(``weights_finite``), so that checkpoint rotation keeps the last good one and export can point to it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from peagle.pipeline.weight_files import has_weights, iter_tensors, weights_entry
from peagle.schemas.checkpoint import METADATA_FILE, WEIGHTS_FINITE_KEY
from peagle.schemas.errors import UserError


def is_finite(tensor: Tensor) -> bool:
    """Whether every value of a floating-point tensor is finite (integer tensors always are)."""
    if not tensor.is_floating_point():
        return True
    if tensor.element_size() == 1:  # float8: isfinite has no kernel for it everywhere
        tensor = tensor.float()
    return bool(torch.isfinite(tensor).all())


def non_finite_tensors(tensors: Mapping[str, Tensor]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity, in the mapping's order."""
    return [name for name, tensor in tensors.items() if isinstance(tensor, Tensor) and not is_finite(tensor)]


def describe(names: list[str], limit: int = 3) -> str:
    """``2 tensors (a, b)``, the first ``limit`` named."""
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"{len(names)} tensor{'' if len(names) == 1 else 's'} ({shown})"


def non_finite_in_export(export_dir: str | os.PathLike) -> list[str]:
    """The tensors of an export's weights (one file or shards) holding a NaN or an infinity, read one at a time."""
    return [name for name, tensor in iter_tensors(export_dir) if not is_finite(tensor)]


def refuse_non_finite_export(export_dir: str | os.PathLike, *, flag: str = "--init-from") -> None:
    """Refuse an export whose weights are not all finite (nothing to check where it has no weights file:
    the loader says that itself).

    Raises:
        UserError: in one line naming the tensors.
    """
    if not has_weights(export_dir):
        return
    try:
        names = non_finite_in_export(export_dir)
    except Exception:  # noqa: BLE001 - a damaged file: the loader refuses it in its own words
        return
    if names:
        raise UserError(f"{flag} {export_dir}: {weights_entry(export_dir)} holds non-finite values (NaN or inf) in "
                        f"{describe(names)}; warm-start from an export of a checkpoint with finite weights")


def recorded_finite(checkpoint: str | os.PathLike) -> bool | None:
    """What a checkpoint's ``metadata.json`` records of its weights: True (all finite), False, or None
    (not recorded: a checkpoint of an older peagle, or unreadable metadata)."""
    try:
        value = json.loads((Path(checkpoint) / METADATA_FILE).read_text()).get(WEIGHTS_FINITE_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None
