"""``peagle store info|verify|check|convert STORE``: summarise a shard store, check every file's
checksum, check what its rows hold, or rewrite it in another hidden-state encoding."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from peagle.cli import app
from peagle.schemas.check_config import CheckConfig, field_docs

store_app = typer.Typer(help="Inspect, check and convert a shard store written by `peagle extract`.", no_args_is_help=True)
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


_CHECK = field_docs(CheckConfig)


@store_app.command("check")
def check(
    store: Path = typer.Argument(..., help=_CHECK["store"], metavar="STORE"),
    target: Optional[str] = typer.Option(None, "--target", help=_CHECK["target"], metavar="MODEL_DIR"),
    samples: int = typer.Option(8, "--samples", help=_CHECK["samples"], metavar="N"),
    seed: int = typer.Option(0, "--seed", help=_CHECK["seed"]),
    device: str = typer.Option("auto", "--device", help=_CHECK["device"], metavar="auto|cpu|cuda"),
    max_zero_rows: int = typer.Option(0, "--max-zero-rows", help=_CHECK["max_zero_rows"]),
    max_non_finite_rows: int = typer.Option(0, "--max-non-finite-rows", help=_CHECK["max_non_finite_rows"]),
    norm_sigmas: float = typer.Option(8.0, "--norm-sigmas", help=_CHECK["norm_sigmas"]),
    max_outlier_fraction: float = typer.Option(0.01, "--max-outlier-fraction", help=_CHECK["max_outlier_fraction"]),
    max_mass_rows: int = typer.Option(0, "--max-mass-rows", help=_CHECK["max_mass_rows"]),
    agreement_ratio: float = typer.Option(0.25, "--agreement-ratio", help=_CHECK["agreement_ratio"]),
    min_agreement_positions: int = typer.Option(16, "--min-agreement-positions",
                                                help=_CHECK["min_agreement_positions"]),
    max_misaligned_samples: int = typer.Option(0, "--max-misaligned-samples", help=_CHECK["max_misaligned_samples"]),
    max_duplicate_rows: int = typer.Option(0, "--max-duplicate-rows", help=_CHECK["max_duplicate_rows"]),
    max_relative_error: float = typer.Option(0.15, "--max-relative-error", help=_CHECK["max_relative_error"]),
    min_top1_agreement: float = typer.Option(0.9, "--min-top1-agreement", help=_CHECK["min_top1_agreement"]),
    json_out: bool = typer.Option(False, "--json", help=_CHECK["json"]),
) -> None:
    """Check what a store holds (the content check `store verify`'s checksums are not): all-zero and
    non-finite rows, norm outliers, implausible top-k mass, misaligned samples, duplicated rows; with
    --target, recompute random samples with the target and compare. Reads every row once. Exit 1
    when a problem is above its threshold, 0 when the store is clean."""
    import json

    from peagle.stages.extract.check import check_store
    from peagle.stages.extract.check_report import format_report

    config = CheckConfig(
        store=str(store), target=target, samples=samples, seed=seed, device=device, max_zero_rows=max_zero_rows,
        max_non_finite_rows=max_non_finite_rows, norm_sigmas=norm_sigmas, max_outlier_fraction=max_outlier_fraction,
        max_mass_rows=max_mass_rows, agreement_ratio=agreement_ratio, min_agreement_positions=min_agreement_positions,
        max_misaligned_samples=max_misaligned_samples, max_duplicate_rows=max_duplicate_rows,
        max_relative_error=max_relative_error, min_top1_agreement=min_top1_agreement, json=json_out)
    report = check_store(config, echo=(lambda line: typer.echo(line, err=True)) if json_out else typer.echo)
    typer.echo(json.dumps(report.to_dict(), indent=1) if json_out else format_report(report))
    if report.failed:
        sys.exit(1)


@store_app.command("convert")
def convert(
    store: Path = typer.Argument(..., help="The store to convert (it is only read).", metavar="STORE"),
    hidden_dtype: str = typer.Option(..., "--hidden-dtype", help="Encoding of the new store's aux hidden states: "
                                     "`fp8` (about half the disk; docs/fp8.md) or `bf16`.", metavar="bf16|fp8"),
    out: Path = typer.Option(..., "--out", help="The new store (created, or continued after a killed run).",
                             metavar="NEW"),
) -> None:
    """Rewrite a store's aux hidden states in another encoding into a new store, shard by shard.

    Parquet rows are copied as they are, tensors re-encoded, each shard committed as extract commits
    (its source checked against its sha256 first). Re-running the same command after a kill converts
    only the shards still missing. The new store continues with `peagle extract --out NEW
    --hidden-dtype ...`; build its draft vocab with `peagle vocab NEW`.
    """
    from peagle.stages.extract.convert import convert_store

    convert_store(store, out, hidden_dtype, echo=typer.echo)
