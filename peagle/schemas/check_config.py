"""The configuration of one `peagle store check` run: every CLI flag is a field, its docstring the help.

Thresholds are judgements of *content* (``store verify`` checks bytes against checksums): each one
says how much of a problem a healthy store may show before the check fails (exit 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peagle.schemas.errors import UserError

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """Settings of `peagle store check`."""

    store: str
    """The shard store to check (written by `peagle extract` or `peagle store convert`)."""

    target: str | None = None
    """Also recompute --samples random samples with this Hugging Face target and compare their aux
    states (relative error per layer) and top-k (top-1 agreement) with what the store holds."""

    samples: int = 8
    """How many random samples --target recomputes."""

    seed: int = 0
    """Which samples --target recomputes (a fixed seed picks the same ones every time)."""

    device: str = "auto"
    """Where --target runs: `cpu`, `cuda`, or `auto` (cuda when available)."""

    max_zero_rows: int = 0
    """All-zero aux rows (one token, one layer) allowed before the check fails. The residual stream
    entering a layer is never exactly zero: such rows are states an engine never wrote."""

    max_non_finite_rows: int = 0
    """Aux or top-k rows holding NaN or inf allowed before the check fails."""

    norm_sigmas: float = 8.0
    """A row is a norm outlier when the log of its L2 norm is this many standard deviations from its
    layer's mean (over every row of the store but each sample's first, whose attention-sink
    activations are legitimately huge)."""

    max_outlier_fraction: float = 0.01
    """Share of a layer's rows that may be norm outliers before the check fails. Real LLMs also put
    massive activations on a few delimiter tokens besides the first: a fraction of a percent of rows."""

    max_mass_rows: int = 0
    """Top-k rows with implausible probability mass (Σ exp(logprobs) above 1 + 0.02, or below half
    of k/V, less than any k of V probabilities can hold) allowed before the check fails."""

    agreement_ratio: float = 0.25
    """A sample is misaligned when the share of its supervised (assistant) tokens that equal the stored
    top-1 of the row before them is below this fraction of the store's median share (rows shifted or
    taken from another sample agree only by chance), and its tokens are also mostly missing from the
    stored top-k rows (under half the store's median share: sampled text keeps them there). Judged
    only when the median is at least 0.2: text a target predicts that badly (random targets, foreign
    text) gives no signal."""

    min_agreement_positions: int = 16
    """Samples with fewer supervised tokens than this are not judged for misalignment (too few to tell)."""

    max_misaligned_samples: int = 0
    """Misaligned samples allowed before the check fails."""

    max_duplicate_rows: int = 0
    """Aux rows equal to the row of another position allowed before the check fails (stale state;
    rows of two samples that share the same prefix are legitimately equal and never counted)."""

    max_relative_error: float = 0.15
    """--target: largest relative error ||stored - recomputed|| / ||recomputed|| of one sample's rows
    of one layer (fp8 rows are about 0.03 off, bf16 about 0.004; another target about 1)."""

    min_top1_agreement: float = 0.9
    """--target: smallest share of a sample's rows whose stored top-1 id is the recomputed one."""

    json: bool = False
    """Print the report as one JSON object (for machines) instead of tables."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise UserError(f"--samples must be >= 1, got {self.samples}")
        if self.device not in DEVICES:
            raise UserError(f"--device must be one of {'|'.join(DEVICES)}, got {self.device!r}")
        for name in ("max_zero_rows", "max_non_finite_rows", "max_mass_rows", "max_misaligned_samples",
                     "max_duplicate_rows", "min_agreement_positions", "seed"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("norm_sigmas", "max_relative_error"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("max_outlier_fraction", "agreement_ratio", "min_top1_agreement"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
