"""``peagle extract``: flags generated from ``ExtractConfig``, then the extract stage (thin)."""

from __future__ import annotations

import typer

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas import extract_config as X

_HELP = """Run the target over chat data and write the shard store (aux hidden states + top-k log-probs).

Prints the plan first (records, estimated tokens and store size, free disk). Re-running the same
command finishes what is missing; several workers (--shard-index/--num-shards) may write into one
store at once, and `peagle store info --store STORE` shows how much of it is committed, which shards
are missing and the command that extracts them. A run whose input is mostly unusable fails
(--max-skipped-share), naming the first bad lines.
"""


def _run(config: X.ExtractConfig) -> None:
    from peagle.stages.extract.run import run_extract

    run_extract(config, echo=typer.echo)


COMMAND = ConfigCommand(
    name="extract", config_class=X.ExtractConfig, run=_run, help=_HELP, more_values="data",
    comma_lists=frozenset({"aux_layers"}),
    metavars={"data": "PATH", "target": "MODEL_DIR", "out": "STORE", "aux_layers": "IDS", "vllm_engine_args": "JSON",
              "mask_token_id": "ID", "max_skipped_share": "SHARE",
              "backend": "|".join(X.BACKENDS), "loss_on": "|".join(X.LOSS_ON), "dtype": "|".join(X.DTYPES),
              "logprob_dtype": "|".join(X.LOGPROB_DTYPES), "hidden_dtype": "|".join(X.HIDDEN_DTYPES), "device": "|".join(X.DEVICES)})
COMMAND.register(app)
