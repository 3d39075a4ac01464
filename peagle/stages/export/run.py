"""`peagle export`: a training checkpoint -> a speculators 'peagle' directory vLLM serves (docs/draft-and-export.md).

The conversion is shared with `peagle eval` (which exports a run before measuring it), so it lives
below the stages: :func:`peagle.model.checkpoint_export.export_checkpoint` reads the checkpoint's
model and config parts (their sizes and sha256 checked against ``metadata.json`` first) and writes
``config.json`` + ``model.safetensors`` atomically through the format's one home,
:mod:`peagle.model.speculators_format`: a reader such as vLLM sees a whole export or none, and
re-exporting replaces an export whole.

A checkpoint whose weights are not all finite (NaN, inf) is refused before anything is written
(:func:`refuse_non_finite_checkpoint`): vLLM would serve it without a word, drafting nothing useful.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from peagle.model.checkpoint_export import export_checkpoint
from peagle.model.finite import describe, non_finite_tensors, recorded_finite
from peagle.pipeline.checkpoint_files import checkpoint_step, list_checkpoints, read_checkpoint_part, resolve_checkpoint
from peagle.schemas.checkpoint import CHECKPOINTS_DIR, MODEL
from peagle.schemas.errors import UserError
from peagle.schemas.export_config import ExportConfig


def run_export(config: ExportConfig, *, echo: Callable[[str], None] = print) -> Path:
    """Export the checkpoint ``config.source`` to ``config.out``; returns the export directory.

    Raises:
        UserError: no usable checkpoint, non-finite weights, or what ``export_checkpoint`` refuses.
    """
    checkpoint = resolve_checkpoint(config.source)
    refuse_non_finite_checkpoint(checkpoint)
    path = export_checkpoint(checkpoint, config.out, verifier_name=config.verifier_name,
                             speculative_tokens=config.speculative_tokens, dtype=config.dtype)
    echo(f"exported {config.source} -> {path}  (serve: vllm serve {path})")
    return path


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
