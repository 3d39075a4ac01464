"""``peagle train``: parse flags into a TrainConfig and run the trainer (DESIGN §1, §5, §7).

The flags are generated from ``TrainConfig``'s fields (name -> ``--name-with-dashes``, docstring ->
help), so the command and the config cannot drift apart. Run it as is for one process, or under
``torchrun --nproc-per-node N`` for data parallelism (every rank runs this same command).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Optional

import typer

from peagle.cli import app
from peagle.cli.config_file import ConfigOption
from peagle.schemas.train_config import TrainConfig, field_docs

_HELP = """Train a P-EAGLE draft on shard stores written by `peagle extract`.

Writes RUN_DIR/metrics.jsonl and RUN_DIR/checkpoints/; re-running the same command resumes from the
newest valid checkpoint. Under `torchrun --nproc-per-node N peagle train ...` it trains with DDP
(--fsdp: FSDP2). Example:

\b
  peagle vocab STORE --draft-vocab-size 32000 && peagle train --store STORE --target MODEL_DIR --out RUN
"""


_METAVARS = {"store": "PATH[:WEIGHT]", "target": "MODEL_DIR", "out": "RUN_DIR", "attention": "auto|flex|sdpa",
             "eval_store": "STORE", "init_from": "EXPORT_DIR"}


def _annotation(field: dataclasses.Field) -> Any:
    """Typer-friendly type of a config field (tuple -> list for a repeatable flag)."""
    hint = typing.get_type_hints(TrainConfig)[field.name]
    if field.name == "store":
        return list[str]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if type(None) in typing.get_args(hint):
        return Optional[args[0]]
    return hint


def _parameters() -> list[inspect.Parameter]:
    docs = field_docs(TrainConfig)
    params = []
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        required = field.default is dataclasses.MISSING
        default = ... if required else field.default
        annotation = _annotation(field)
        if annotation is bool:
            decls = [f"{flag}/--no-{flag[2:]}"]
        else:
            decls = [flag]
        option = typer.Option(default, *decls, help=docs[field.name], show_default=not required,
                              metavar=_METAVARS.get(field.name))
        params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
    params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=ConfigOption,
                                    annotation=Optional[str]))
    return params


def train(**flags: Any) -> None:
    flags.pop("config", None)
    config = TrainConfig(**flags)
    from peagle.stages.train.loop import run_training

    run_training(config)


train.__signature__ = inspect.Signature(_parameters())  # type: ignore[attr-defined]
train.__annotations__ = {p.name: p.annotation for p in train.__signature__.parameters.values()}  # type: ignore[attr-defined]
app.command("train", help=_HELP)(train)
