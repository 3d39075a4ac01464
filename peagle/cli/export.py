"""``peagle export RUN_DIR|CHECKPOINT --out DIR``: the speculators 'peagle' directory vLLM serves."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from peagle.cli import app
from peagle.cli.config_file import ConfigOption


@app.command("export")
def export(
    source: Path = typer.Argument(..., help="Training run directory (its newest valid checkpoint is exported) or "
                                  "one checkpoint directory (RUN_DIR/checkpoints/step-N)."),
    out: Path = typer.Option(..., "--out", help="Export directory to create (an existing export there is "
                             "replaced whole; anything else there is refused)."),
    verifier_name: Optional[str] = typer.Option(
        None, "--verifier-name", help="Verifier recorded in the export and served by `LLM(model=OUT)`. Default: "
        "the target path given to training; a hub-style name (org/model) makes the export portable."),
    speculative_tokens: Optional[int] = typer.Option(
        None, "--speculative-tokens", help="K: draft tokens vLLM proposes per step. Default: the trained depths."),
    dtype: str = typer.Option("float32", "--dtype", help="Weight dtype in model.safetensors: float32 (lossless) "
                              "or bfloat16 (half the size; vLLM casts to the served dtype anyway)."),
    config: Optional[str] = ConfigOption,
) -> None:
    """Write OUT/config.json + OUT/model.safetensors (the speculators 'peagle' format) atomically.

    Serve it with `vllm serve OUT` or `LLM(model=OUT)`: vLLM then loads the verifier named inside and
    runs parallel drafting. (A plain `speculative_config` without `"parallel_drafting": true` would
    silently draft one token at a time.)
    """
    from peagle.stages.export.run import ExportConfig, run_export

    path = run_export(ExportConfig(source=str(source), out=str(out), verifier_name=verifier_name,
                                   speculative_tokens=speculative_tokens, dtype=dtype))
    typer.echo(f"exported {source} -> {path}  (serve: vllm serve {path})")
