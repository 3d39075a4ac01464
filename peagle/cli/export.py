"""``peagle export``: flags generated from ``ExportConfig``, then the export stage."""

from __future__ import annotations

import typer

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas.export_config import EXPORT_DTYPES, ExportConfig

_HELP = """Write OUT/config.json + OUT/model.safetensors atomically: the speculators 'peagle' format for a
P-EAGLE draft, 'eagle3' for an EAGLE-3 one (`train --method eagle3`); in shards and their index with
--max-file-mib.

Serve it with `vllm serve OUT` or `LLM(model=OUT)`: vLLM then loads the verifier named inside and
runs parallel drafting (peagle) or drafts one token per forward (eagle3). (For a P-EAGLE export, a
plain `speculative_config` without `"parallel_drafting": true` would silently draft one token at a
time.) A checkpoint whose weights hold a NaN or inf is refused, naming the run's newest checkpoint
with finite weights.

The form that travels: `--without-target-embedding` leaves out the target's embedding, frozen in a
draft trained with `--no-train-embeddings` (most of a small draft's bytes), and records its sha256;
`peagle export THAT_DIR --target T --out DIR` puts the target's rows back, checked against it.
"""


def _run(config: ExportConfig) -> None:
    from peagle.stages.export.run import run_export

    run_export(config, echo=typer.echo)


COMMAND = ConfigCommand(name="export", config_class=ExportConfig, run=_run, help=_HELP, arguments=("source",),
                        metavars={"source": "SOURCE", "out": "DIR", "target": "DIR",
                                  "speculative_schedule": "SCHEDULE", "dtype": "|".join(EXPORT_DTYPES)})
COMMAND.register(app)
