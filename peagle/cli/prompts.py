"""``peagle prompts --target MODEL_DIR --out FILE``: training prompts written by the target itself
(docs/prompts.md). Flags generated from ``PromptsConfig``."""

from __future__ import annotations

import typer

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas import prompts_config as P

_HELP = """Write training prompts in the target's own distribution, for when you have none (Magpie): the
chat template is rendered up to where a user's text starts, and the target samples the user's message
until it ends the turn. Samples are filtered (length, truncated, not a request, duplicates, held-out
phrases and prompts, each counted) and written as prompt-only chat records for `peagle extract
--regenerate`, which has the target answer them.

Example (the second command is the usual extract, with --regenerate):

\b
  peagle prompts --target MODEL_DIR --out prompts.jsonl --num-prompts 20000 --exclude-phrases heldout.txt
  peagle extract --data prompts.jsonl --target MODEL_DIR --out STORE --regenerate
"""


def _run(config: P.PromptsConfig) -> None:
    from peagle.stages.extract.prompts import run_prompts

    run_prompts(config, echo=typer.echo)


COMMAND = ConfigCommand(
    name="prompts", config_class=P.PromptsConfig, run=_run, help=_HELP,
    choices={"backend": P.BACKENDS, "device": P.DEVICES},
    metavars={"target": "MODEL_DIR", "out": "FILE", "exclude_phrases": "FILE", "exclude_prompts": "FILE",
              "max_samples_factor": "NUM", "dtype": "|".join(P.DTYPES)})
COMMAND.register(app)
