"""The optimizer of `peagle train` and its learning-rate schedule: the ``optim`` part of ``TrainConfig``.

``stages/train/optim.build_optimizer`` builds the optimizer from this part alone and the step's
LambdaLR takes ``warmup_steps`` from it, so a new optimizer knob is a field here and its use there.
Its fields are `peagle train` flags of the same names (the docstrings are their help). What needs
another part (Muon refuses ``--fsdp``) is checked by ``TrainConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peagle.schemas.errors import UserError, at_least

OPTIMIZERS = ("adamw", "muon")
MUON_NS_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """Which optimizer updates the draft, at what rates, warmed up how long, clipped where."""

    lr: float = 1e-4
    """Peak learning rate of the AdamW updates (after warmup; cosine decay to 10% of it by the last
    step): with Muon (the default optimizer), of the parameters outside the decoder layers' matrices
    (--muon-lr is theirs); with --optimizer adamw, of every parameter."""

    warmup_steps: int = 100
    """Linear learning-rate warmup from 0 over this many optimizer steps."""

    weight_decay: float = 0.01
    """Decoupled weight decay on 2-D weights except embed_tokens (with --optimizer muon, on Muon's
    matrices too, each scaled by its own learning rate)."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 turns clipping off)."""

    optimizer: str = "muon"
    """`muon` (default): Muon (momentum orthogonalised by Newton-Schulz) at --muon-lr on the decoder
    layers' 2-D weights (attention and MLP projections), AdamW at --lr on the rest (embeddings, fc,
    lm_head, norms, mask_hidden); it raised acceptance length 12% over AdamW at the same steps
    on the toy target (benchmarks/quality.py, README "Draft quality"). `adamw`: AdamW on every parameter at --lr;
    the one --fsdp supports."""

    muon_lr: float = 0.02
    """Peak learning rate of Muon's matrices with --optimizer muon (warmup and cosine decay as --lr,
    so the two keep their ratio). Muon's step has a fixed spectral size, so it needs a larger rate
    than AdamW's: on the quality benchmark 0.02 to 0.1 did alike and 0.01 lost Muon's gain."""

    muon_ns_dtype: str = "float32"
    """Dtype of Muon's Newton-Schulz iterations with --optimizer muon: `float32`, or `bfloat16` (what
    Muon's authors run: the five iterations only need singular values near 1, and bf16 keeps them within
    ~3 %). A cost per optimizer step, not per token: a large share of a deep draft's CPU step
    (benchmarks/train_step_profile.py); bf16 matmuls run faster where the CPU has AVX512-BF16 or AMX."""

    def __post_init__(self) -> None:
        at_least("warmup_steps", self.warmup_steps, 0)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"--lr must be > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise UserError(f"--grad-clip must be >= 0 (0 = off), got {self.grad_clip}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer must be one of {'|'.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not (math.isfinite(self.muon_lr) and self.muon_lr > 0):
            raise UserError(f"--muon-lr must be > 0, got {self.muon_lr}")
        if self.muon_ns_dtype not in MUON_NS_DTYPES:
            raise UserError(f"--muon-ns-dtype must be one of {'|'.join(MUON_NS_DTYPES)}, got {self.muon_ns_dtype!r}")
