"""``peagle vocab --store STORE --draft-vocab-size N``: build the draft vocabulary of a store
(docs/draft-and-export.md). Flags generated from ``VocabConfig``."""

from __future__ import annotations

from pathlib import Path

import typer

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas.vocab_config import VocabConfig

_HELP = """Count the supervised target tokens of STORE (one pass over its Parquet columns, no tensors) and
write STORE/vocab/draft-N.safetensors (d2t, t2d, selected ids, counts) and draft-N.json (coverage,
the shards counted). An incomplete store is refused (--allow-incomplete counts what is committed).
--heldout-store also measures the coverage of held-out text, at this size and its neighbours."""


def _run(config: VocabConfig) -> None:
    from peagle.stages.train.vocab import build_draft_vocab, vocab_stem

    built = build_draft_vocab(config.store, config.draft_vocab_size, progress=not config.quiet,
                              allow_incomplete=config.allow_incomplete, heldout_store=config.heldout_store,
                              echo=lambda line: typer.echo(line, err=True))
    kind = "identity (no d2t/t2d)" if built.identity else f"{built.draft_vocab_size} of {built.target_vocab_size} ids"
    typer.echo(f"draft vocab: {kind}; coverage {built.coverage:.4f} of {built.num_supervised_tokens} "
               f"supervised tokens; written to {Path(config.store) / vocab_stem(config.draft_vocab_size)}.json")
    if built.heldout:
        h = built.heldout
        sizes = "  ".join(f"{n:,}: {c:.4f}" for n, c in h["coverage_by_size"])
        typer.echo(f"held-out coverage {h['coverage']:.4f} of {h['num_supervised_tokens']:,} supervised tokens of "
                   f"{h['store']} (an upper bound on acceptance at every depth); by draft vocab size: {sizes}")


COMMAND = ConfigCommand(name="vocab", config_class=VocabConfig, run=_run, help=_HELP, old_positional="store",
                        metavars={"store": "STORE", "draft_vocab_size": "N", "heldout_store": "STORE"})
COMMAND.register(app)
