"""The configuration of one `peagle vocab` run: every CLI flag is a field, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.errors import UserError


@dataclass(frozen=True, kw_only=True)
class VocabConfig:
    """Settings of `peagle vocab` (docs/draft-and-export.md)."""

    store: str
    """The shard store whose supervised tokens are counted (written by `peagle extract`); the vocab is
    written into it (STORE/vocab/draft-N.*)."""

    draft_vocab_size: int
    """Number of target tokens the draft's lm_head covers: the most frequent supervised tokens of the
    store (ties: lower id). Equal to the target vocab means no mapping."""

    heldout_store: str | None = None
    """A store of held-out text from the same target (e.g. the one `peagle train --eval-store` evaluates
    on): also report and record how much of its supervised tokens the vocab covers, at this size and
    at N/4 to 8N. The share of unseen tokens the draft can propose at all bounds its acceptance; the
    store's own coverage flatters a small vocab."""

    allow_incomplete: bool = False
    """Count an incomplete store (some planned shards not committed yet, `peagle store info` names them),
    saying how much is missing; by default such a store is refused. The vocab records the shards it
    counted (for `peagle train --follow`, which trains while extraction goes on)."""

    quiet: bool = False
    """No progress bar."""

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise UserError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
