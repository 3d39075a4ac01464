"""``peagle store info|verify STORE``: summarise a shard store, or check every file's checksum."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from peagle.cli import app

store_app = typer.Typer(help="Inspect a shard store written by `peagle extract`.", no_args_is_help=True)
app.add_typer(store_app, name="store")


@store_app.command("info")
def info(store: Path = typer.Argument(..., help="Shard store directory.")) -> None:
    """Samples, tokens, shards, bytes/token (on disk vs raw tensor bytes), skipped records, settings."""
    from peagle.stages.extract.info import format_info, store_info

    typer.echo(format_info(store_info(store)))


@store_app.command("verify")
def verify(store: Path = typer.Argument(..., help="Shard store directory.")) -> None:
    """Check the size and sha256 of every committed shard file; exit 1 on any mismatch."""
    from peagle.stages.extract.info import verify_store

    num_shards, problems = verify_store(store)
    for problem in problems:
        typer.echo(f"{store}: {problem}", err=True)
    if problems:
        typer.echo(f"verify FAILED: {len(problems)} problem(s) in {num_shards} committed shards", err=True)
        sys.exit(1)  # not typer.Exit: peagle.cli.main runs click with standalone_mode=False, which returns
        #              an Exit's code instead of exiting with it
    typer.echo(f"verify ok: {num_shards} committed shards, every file matches its commit record")
