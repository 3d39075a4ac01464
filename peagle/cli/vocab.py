"""``peagle vocab STORE --draft-vocab-size N``: build the draft vocabulary of a store (docs/draft-and-export.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from peagle.cli import app
from peagle.cli.config_file import ConfigOption


@app.command("vocab")
def vocab(
    store: Path = typer.Argument(..., help="Shard store written by `peagle extract`."),
    draft_vocab_size: int = typer.Option(
        ..., "--draft-vocab-size", help="Number of target tokens the draft's lm_head covers: the most frequent "
        "supervised tokens of the store (ties: lower id). Equal to the target vocab means no mapping."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    config: Optional[str] = ConfigOption,
) -> None:
    """Count the supervised target tokens of STORE (one pass over its Parquet columns, no tensors) and
    write STORE/vocab/draft-N.safetensors (d2t, t2d, selected ids, counts) and draft-N.json (coverage)."""
    from peagle.stages.train.vocab import build_draft_vocab, vocab_stem

    built = build_draft_vocab(store, draft_vocab_size, progress=not quiet)
    kind = "identity (no d2t/t2d)" if built.identity else f"{built.draft_vocab_size} of {built.target_vocab_size} ids"
    typer.echo(f"draft vocab: {kind}; coverage {built.coverage:.4f} of {built.num_supervised_tokens} "
               f"supervised tokens; written to {Path(store) / vocab_stem(draft_vocab_size)}.json")
