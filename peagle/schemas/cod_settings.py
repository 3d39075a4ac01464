"""K and how COD sampling draws a sample's deeper depths (docs/cod.md): one config, three users.

The same object is the ``cod`` part of ``TrainConfig`` (its fields are the `peagle train` flags of
the same names, their docstrings the help), travels whole into each stream's ``LoaderConfig``, and
gives the COD functions of ``stages/train/cod.py`` their defaults, so a default is written here once
and a new knob is a field here and its use in the draw. Its fields fix the data stream: the loader's
resume identity holds each of them (``cod.<field>``), so a field added here makes checkpoints written
before it refuse to resume until the loader's identity says what its absence meant.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.errors import UserError, at_least

PEAGLE_ONLY_COD = ("down_sample_ratio", "down_sample_ratio_min", "max_anchors")
"""The fields of the draw itself, which `--method eagle3` (every chain, nothing drawn) refuses set."""


@dataclass(frozen=True, kw_only=True)
class CodSettings:
    """How many depths a draft trains, and how COD draws the elements of each (docs/cod.md)."""

    num_depths: int = 8
    """K: how many tokens the draft proposes per step (depths 0..K-1 are trained): in one forward
    (peagle), or in K forwards, the steps eagle3 unrolls."""

    down_sample_ratio: float = 0.7
    """r: COD sampling keeps a fraction max(r^d, r_min) of the supervised positions at depth d
    (--method peagle; eagle3 trains every chain)."""

    down_sample_ratio_min: float = 0.2
    """r_min: the floor of the per-depth COD keep fraction (--method peagle)."""

    max_anchors: int | None = None
    """(--method peagle) Cap M on the draft chains of each sample: at most M of its positions start a chain (get
    depth 1 elements); every deeper element extends one of those chains, and the deeper depths'
    counts shrink by the factor that capped depth 1. A sample of T positions then adds at most
    M x (K-1) elements to its T depth-0 ones. Per sample, also when samples are packed into one
    row. Default: no cap."""

    def __post_init__(self) -> None:
        at_least("num_depths", self.num_depths, 1)
        if self.max_anchors is not None:
            at_least("max_anchors", self.max_anchors, 1)
        if not 0 < self.down_sample_ratio <= 1:
            raise UserError(f"--down-sample-ratio must be in (0, 1], got {self.down_sample_ratio}")
        if not 0 <= self.down_sample_ratio_min <= 1:
            raise UserError(f"--down-sample-ratio-min must be in [0, 1], got {self.down_sample_ratio_min}")
