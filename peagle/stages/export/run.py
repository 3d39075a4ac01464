"""`peagle export`: a training checkpoint -> a speculators 'peagle' directory vLLM serves (docs/draft-and-export.md).

The conversion is shared with `peagle eval` (which exports a run before measuring it), so it lives
below the stages: :func:`peagle.model.checkpoint_export.export_checkpoint` reads the checkpoint's
model and config parts (their sizes and sha256 checked against ``metadata.json`` first) and writes
``config.json`` + ``model.safetensors`` atomically through the format's one home,
:mod:`peagle.model.speculators_format`: a reader such as vLLM sees a whole export or none, and
re-exporting replaces an export whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from peagle.model.checkpoint_export import export_checkpoint
from peagle.schemas.export_config import ExportConfig


def run_export(config: ExportConfig, *, echo: Callable[[str], None] = print) -> Path:
    """Export the checkpoint ``config.source`` to ``config.out``; returns the export directory."""
    path = export_checkpoint(config.source, config.out, verifier_name=config.verifier_name,
                             speculative_tokens=config.speculative_tokens, dtype=config.dtype)
    echo(f"exported {config.source} -> {path}  (serve: vllm serve {path})")
    return path
