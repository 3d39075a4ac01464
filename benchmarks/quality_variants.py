"""The variants of the quality benchmark (benchmarks/quality.py): the flags each trains with, which
other variant each is compared with, and which ones the tables of docs/quality.md run.

A variant is one line of :data:`VARIANTS`: ``peagle train`` flags over :data:`BASE_TRAIN`. Most
change a P-EAGLE setting; the ``eagle3-*`` variants change the method (``--method eagle3``: EAGLE-3
with training-time test, docs/methods.md) on top of today's defaults, on the same store and budget,
and are compared with the P-EAGLE variant of the same K. A variant's method is its ``--method``
(P-EAGLE without one); an EAGLE-3 run drops the flags only P-EAGLE takes (its COD sampling and
``--max-anchors``, ``peagle.schemas.train_config.PEAGLE_ONLY``): it trains every chain.
"""

from __future__ import annotations

from peagle.schemas.train_config import PEAGLE_ONLY

Flags = dict[str, "str | bool"]
"""``peagle train`` flags: a value, or a switch (True: ``--name``, False: ``--no-name``)."""

BASE_TRAIN: Flags = {
    "--num-layers": "1", "--num-depths": "5", "--lr": "3e-3", "--warmup-steps": "30", "--optimizer": "adamw",
    "--norm-before-residual": False, "--norm-before-fc": False, "--fc-norm": False,
    "--down-sample-ratio": "0.7", "--down-sample-ratio-min": "0.2", "--eval-every": "0", "--save-every": "0",
}
"""`peagle train` flags every variant starts from (the budget flags come from ``quality.Budget``). The
baseline is the draft before this benchmark changed the defaults: AdamW, no EAGLE-3.1 norms. The
winners (Muon, the norms) are named explicitly, so every committed record keeps its meaning."""

VARIANTS: dict[str, Flags] = {
    "baseline": {},
    "k3": {"--num-depths": "3"},  # train fewer depths than are served: cheaper steps
    "k8": {"--num-depths": "8"},  # train more depths than are served
    "rmin0": {"--down-sample-ratio-min": "0"},  # deep depths decay geometrically (fewer deep elements)
    "rmin0.5": {"--down-sample-ratio-min": "0.5"},  # at least half of the positions at every depth
    "r0.5": {"--down-sample-ratio": "0.5"},
    "anchors8": {"--max-anchors": "8"},  # at most 8 chains per sample
    "layers2": {"--num-layers": "2"},
    "lr1e-3": {"--lr": "1e-3"},
    "lr1e-2": {"--lr": "1e-2"},  # AdamW at a higher rate: does it close Muon's gap?
    "muon": {"--optimizer": "muon", "--muon-lr": "0.02"},  # Muon on the layers' matrices, AdamW on the rest
    "muon-lr0.01": {"--optimizer": "muon", "--muon-lr": "0.01"},
    "muon-lr0.05": {"--optimizer": "muon", "--muon-lr": "0.05"},
    "muon-lr0.1": {"--optimizer": "muon", "--muon-lr": "0.1"},
    "tv": {"--loss": "tv"},  # total variation instead of forward KL (docs/loss.md)
    "qwen3": {"--draft-architecture": "qwen3"},  # q/k RMSNorm on every head before RoPE
    "norm-before-residual": {"--norm-before-residual": True},
    "norm-before-fc": {"--norm-before-fc": True},
    "fc-norm": {"--fc-norm": True},
    "all-norms": {"--norm-before-residual": True, "--norm-before-fc": True, "--fc-norm": True},
}
"""Named variants: flags that replace or extend :data:`BASE_TRAIN`."""
VARIANTS["muon-all-norms"] = {**VARIANTS["muon"], **VARIANTS["all-norms"]}  # combinations, from their parts
VARIANTS["muon-lr0.05-all-norms"] = {**VARIANTS["muon-lr0.05"], **VARIANTS["all-norms"]}
VARIANTS["fp8-matmuls"] = {**VARIANTS["muon-all-norms"], "--fp8-matmuls": True}  # today's defaults, fp8 matmuls
DEFAULTS = "muon-all-norms"
"""The variant that is ``peagle train``'s defaults (Muon, the three norms)."""
VARIANTS["defaults-tv"] = {**VARIANTS[DEFAULTS], "--loss": "tv"}
VARIANTS["defaults-k3"] = {**VARIANTS[DEFAULTS], "--num-depths": "3"}
VARIANTS["defaults-k8"] = {**VARIANTS[DEFAULTS], "--num-depths": "8"}
VARIANTS["defaults-frozen-emb"] = {**VARIANTS[DEFAULTS], "--train-embeddings": False}
# A bigger draft vocab: the held-out text's tail the 2,048 most frequent ids miss (quality.py builds
# each size's vocab on the draft store before the first run that needs it).
VARIANTS["defaults-v4096"] = {**VARIANTS[DEFAULTS], "--draft-vocab-size": "4096"}
VARIANTS["defaults-v8192"] = {**VARIANTS[DEFAULTS], "--draft-vocab-size": "8192"}
# Against memorising (training agreement at depth 1 is 0.82 where held-out is 0.45): stronger weight
# decay; and a second layer, which P-EAGLE's mask slots need more than EAGLE-3's steps do.
VARIANTS["defaults-wd0.1"] = {**VARIANTS[DEFAULTS], "--weight-decay": "0.1"}
VARIANTS["defaults-layers2"] = {**VARIANTS[DEFAULTS], "--num-layers": "2"}
# The other method on the same store and budget: EAGLE-3 with training-time test, K = 3 and 5 steps
# unrolled (served at K = 5 like every variant), today's defaults otherwise.
VARIANTS["eagle3-k3"] = {**VARIANTS[DEFAULTS], "--method": "eagle3", "--num-depths": "3"}
VARIANTS["eagle3-k5"] = {**VARIANTS[DEFAULTS], "--method": "eagle3", "--num-depths": "5"}

REFERENCE: dict[str, str] = {name: "muon" for name in VARIANTS if name.startswith("muon-")}
REFERENCE.update({name: DEFAULTS for name in VARIANTS if name == "fp8-matmuls" or name.startswith("defaults-")})
REFERENCE.update({"eagle3-k3": "defaults-k3", "eagle3-k5": DEFAULTS})  # each method against the other, same K
"""Variants that change one thing over another variant: their summary also carries ``vs_reference``
(Welch against it): "does it help on top of Muon", "does it help on top of today's defaults", "does
EAGLE-3 beat P-EAGLE at this K" decide a default."""

DEFAULT_VARIANTS = ("muon", "all-norms", DEFAULTS, "defaults-tv", "defaults-k3", "defaults-k8", "defaults-frozen-emb",
                    "eagle3-k3", "eagle3-k5")
"""The "Draft quality" table of docs/quality.md on the real model: what a bare ``python benchmarks/quality.py`` runs."""

TOY_VARIANTS = ("muon", "muon-lr0.01", "muon-lr0.05", "muon-lr0.1", "lr1e-2",
                "norm-before-residual", "norm-before-fc", "fc-norm", "all-norms", "muon-all-norms",
                "muon-lr0.05-all-norms", "qwen3", "tv", "k3", "k8", "rmin0.5", "anchors8")
"""The toy target's table (``--target toy``; results/cpu/quality_toy.json)."""

PEAGLE_ONLY_FLAGS = tuple(f"--{name.replace('_', '-')}" for name in PEAGLE_ONLY)
"""The flags `peagle train --method eagle3` refuses."""


def method_of(variant: str) -> str:
    """The training method a variant trains with (``peagle`` unless it names another)."""
    return str(VARIANTS[variant].get("--method", "peagle"))


def variant_flags(variant: str, budget_flags: Flags) -> list[str]:
    """The command-line flags of one run: :data:`BASE_TRAIN`, then ``budget_flags`` (steps, tokens,
    seed, ...), then the variant's own; without the P-EAGLE-only ones for another method."""
    flags = {**BASE_TRAIN, **budget_flags, **VARIANTS[variant]}
    if method_of(variant) != "peagle":
        flags = {flag: value for flag, value in flags.items() if flag not in PEAGLE_ONLY_FLAGS}
    return [part for flag, value in flags.items() for part in render(flag, value)]


def render(flag: str, value: str | bool) -> tuple[str, ...]:
    """One flag as command-line words: a switch as ``--name``/``--no-name``."""
    if isinstance(value, bool):
        return (flag,) if value else (f"--no-{flag[2:]}",)
    return (flag, value)
