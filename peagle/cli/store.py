"""``peagle store info|verify|check|convert --store STORE``: summarise a shard store (and how much of its
plan is committed), check every file's checksum and that the store is complete, check what its rows
hold, or rewrite it in another hidden-state encoding. Flags generated from each verb's config."""

from __future__ import annotations

import sys

import typer

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas.check_config import DEVICES, CheckConfig
from peagle.schemas.store import HIDDEN_DTYPES
from peagle.schemas.store_config import ConvertConfig, StoreConfig

store_app = typer.Typer(help="Inspect, check and convert a shard store written by `peagle extract`.", no_args_is_help=True)
app.add_typer(store_app, name="store")


def _info(config: StoreConfig) -> None:
    from peagle.stages.store.info import format_info, store_info

    typer.echo(format_info(store_info(config.store)))


def _verify(config: StoreConfig) -> None:
    from peagle.stages.store.info import verify_store

    num_shards, problems = verify_store(config.store)
    for problem in problems:
        typer.echo(f"{config.store}: {problem}", err=True)
    if problems:
        typer.echo(f"verify FAILED: {len(problems)} problem(s) in {num_shards} committed shards", err=True)
        sys.exit(1)  # not typer.Exit: peagle.cli.main runs click with standalone_mode=False, which returns
        #              an Exit's code instead of exiting with it
    typer.echo(f"verify ok: {num_shards} committed shards, every planned shard committed, every file matches "
               "its commit record")


def _check(config: CheckConfig) -> None:
    import json

    from peagle.stages.store.check import check_store
    from peagle.stages.store.check_report import format_report

    report = check_store(config, echo=(lambda line: typer.echo(line, err=True)) if config.json else typer.echo)
    typer.echo(json.dumps(report.to_dict(), indent=1) if config.json else format_report(report))
    if report.failed:
        sys.exit(1)


def _convert(config: ConvertConfig) -> None:
    from peagle.stages.store.convert import convert_store

    convert_store(config.store, config.out, config.hidden_dtype, echo=typer.echo)


_STORE = {"store": "STORE"}
COMMANDS = (
    ConfigCommand(name="info", group="store", config_class=StoreConfig, run=_info, old_positional="store",
                  metavars=_STORE, help="Samples, tokens, shards (committed of planned: the missing ones and the "
                  "command that extracts them), bytes/token (on disk vs raw tensor bytes), skipped records, settings."),
    ConfigCommand(name="verify", group="store", config_class=StoreConfig, run=_verify, old_positional="store",
                  metavars=_STORE, help="Check the size and sha256 of every committed shard file, and that every "
                  "planned shard is committed; exit 1 on any mismatch or missing shard."),
    ConfigCommand(name="check", group="store", config_class=CheckConfig, run=_check, old_positional="store",
                  metavars={**_STORE, "target": "MODEL_DIR", "device": "|".join(DEVICES)},
                  help="Check what a store holds (the content check `store verify`'s checksums are not): all-zero "
                  "and non-finite rows, norm outliers, implausible top-k mass, misaligned samples, duplicated rows, "
                  "no supervised token at all; with --target, recompute random samples with the target and compare. "
                  "Reads every row once. Exit 1 when a problem is above its threshold, 0 when the store is clean."),
    ConfigCommand(name="convert", group="store", config_class=ConvertConfig, run=_convert, old_positional="store",
                  metavars={**_STORE, "out": "NEW", "hidden_dtype": "|".join(HIDDEN_DTYPES)},
                  help="""Rewrite a store's aux hidden states in another encoding into a new store, shard by shard.

Parquet rows are copied as they are, tensors re-encoded, each shard committed as extract commits (its
source checked against its sha256 first). Re-running the same command after a kill converts only the
shards still missing. The new store continues with `peagle extract --out NEW --hidden-dtype ...`;
build its draft vocab with `peagle vocab --store NEW`.
"""),
)
for _command in COMMANDS:
    _command.register(store_app)
