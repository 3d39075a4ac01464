"""Acceptance length, defined once (docs/draft-and-export.md), and the histogram every evaluation feeds it.

One verification step (or one teacher-forced chain) proposes K draft tokens and accepts a prefix of
``a`` of them (0 <= a <= K); the target then adds one token of its own, so the step yields a + 1
tokens. Every mode of `peagle eval` counts steps into an :class:`AcceptanceHistogram` (gpt-fast's
``accept_counts``: ``counts[a]`` steps accepted exactly a drafts). The per-depth view is what vLLM
reports (``spec_decode_num_accepted_tokens_per_pos``): ``accepted_at_depth[d-1]`` = steps whose
draft d was accepted (i.e. a >= d). :func:`acceptance_lengths` turns that per-depth view into

    AL(k) = 1 + Σ_{d=1..k} accepted_at_depth[d] / num_steps        for k = 1 .. K,

which for teacher-forced chains is exactly ``1 + Σ_d mean_over_anchors(Π_{j<=d} [draft_j ==
target argmax_j])`` (a chain is accepted through depth d iff all of its first d drafts match), and
for a live decoding loop the mean number of tokens per verification step. AL(k) for k < K is read
from the same K-deep steps by truncation: a step that accepted a drafts would have accepted
min(a, k) with only k drafts, because draft j never depends on how many drafts follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


def acceptance_lengths(accepted_at_depth: Sequence[float], num_steps: float) -> list[float]:
    """``[AL(1), ..., AL(K)]`` from per-depth accepted counts (see module docstring). NaN if no steps."""
    if num_steps <= 0:
        return [float("nan")] * len(accepted_at_depth)
    out, total = [], 1.0
    for count in accepted_at_depth:
        total += float(count) / float(num_steps)
        out.append(total)
    return out


@dataclass
class AcceptanceHistogram:
    """``counts[a]``: steps (or chains) that accepted exactly ``a`` of ``num_depths`` drafts."""

    num_depths: int
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (self.num_depths + 1)
        assert len(self.counts) == self.num_depths + 1, "histogram has K + 1 bins"

    def add(self, num_accepted: int, times: int = 1) -> None:
        assert 0 <= num_accepted <= self.num_depths, f"accepted {num_accepted} of {self.num_depths}"
        self.counts[num_accepted] += times

    def merge(self, other: "AcceptanceHistogram") -> None:
        assert other.num_depths == self.num_depths, "histograms of different K"
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]

    @property
    def num_steps(self) -> int:
        return sum(self.counts)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(a * c for a, c in enumerate(self.counts))

    def accepted_at_depth(self) -> list[int]:
        """Steps whose draft d was accepted (a >= d), for d = 1..K: vLLM's per-position counts."""
        return [sum(self.counts[d:]) for d in range(1, self.num_depths + 1)]

    def per_depth_acceptance(self) -> list[float]:
        """P(draft d accepted) = P(a >= d), d = 1..K (vLLM's per-position acceptance rate)."""
        n = self.num_steps
        return [c / n if n else float("nan") for c in self.accepted_at_depth()]

    def conditional_acceptance(self) -> list[float]:
        """P(draft d accepted | drafts 1..d-1 accepted), d = 1..K (NaN where nothing reached d)."""
        reached = [self.num_steps] + self.accepted_at_depth()
        return [reached[d] / reached[d - 1] if reached[d - 1] else float("nan")
                for d in range(1, self.num_depths + 1)]

    def acceptance_lengths(self) -> list[float]:
        """``[AL(1), ..., AL(K)]`` (module docstring)."""
        return acceptance_lengths(self.accepted_at_depth(), self.num_steps)

    def acceptance_length(self) -> float:
        """AL(K): mean tokens per verification step with all K drafts."""
        return self.acceptance_lengths()[-1] if self.num_depths else 1.0

    def to_dict(self) -> dict:
        return {
            "num_depths": self.num_depths,
            "num_steps": self.num_steps,
            "accept_counts": list(self.counts),
            "accepted_at_depth": self.accepted_at_depth(),
            "per_depth_acceptance": self.per_depth_acceptance(),
            "conditional_acceptance": self.conditional_acceptance(),
            "acceptance_length_by_k": self.acceptance_lengths(),
            "acceptance_length": self.acceptance_length(),
        }
