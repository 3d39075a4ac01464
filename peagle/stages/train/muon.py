"""Muon for the draft's hidden matrices, AdamW for everything else, in one optimizer.

Muon (MomentUm Orthogonalized by Newton-Schulz) replaces the update of a 2-D weight by the
orthogonal matrix nearest to its momentum: for momentum ``M = U S Vᵀ`` (SVD) the step direction is
``U Vᵀ``, every singular value set to one. Plain SGD/Adam updates of a transformer's matrices are
dominated by a few directions (a low effective rank); equalising the singular values lets the
rare directions learn as fast as the common ones, which is what lets Muon train at higher learning
rates per step. An SVD per matrix per step is too slow on accelerators, so ``U Vᵀ`` is approximated
by a few Newton-Schulz iterations of an odd matrix polynomial, matmuls only (:func:`newton_schulz`).

Which parameters get which rule (:func:`muon_param_groups`), following common practice:

* **Muon**: the 2-D weights inside the decoder layers (``layers.*``: q/k/v/o projections and the
  MLP's gate/up/down). They map normalised hidden activations to hidden activations, the case
  Muon's argument is about, and layer 0's 2H-wide q/k/v read normed inputs too.
* **AdamW**: ``embed_tokens`` (a lookup table: each step touches the rows of the tokens seen, and
  its "singular directions" mean nothing); ``lm_head`` when trained (an output layer whose rows
  are per-token classifiers; the Muon authors keep the head on AdamW); ``fc``, the input projection
  of the target's concatenated aux states (its inputs are another network's un-normalised features
  of very different scales per layer, like an embedding of a foreign space, and it is the first
  layer, which Muon practice leaves to AdamW); every norm gain and ``mask_hidden`` (vectors, not
  matrices: there is nothing to orthogonalise). Any future 1-D parameter (q/k norms, extra
  EAGLE-3.1 norms) falls to AdamW by the same rule.

The two rules need different learning rates: Muon's step ``lr · scale · U Vᵀ`` has a fixed
spectral size, so its ``lr`` is about 10x AdamW's (0.02 vs ~2e-3 here). ``scale`` is
``sqrt(max(1, rows / cols))`` by default (``"spectral"``: tall matrices get the same RMS change per
output as square ones), or ``0.2 · sqrt(max(rows, cols))`` (``"match_adamw"``: the update RMS of
AdamW, so both rules can share one learning rate and weight decay).

One optimizer holds both rules (each param group has ``muon: True/False``), so one ``LambdaLR``
scales every group's own base rate, and one ``state_dict`` holds everything for an exact resume.
The Muon path needs whole matrices: under FSDP2 (DTensor shards) it refuses rather than
orthogonalising a shard.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

QUINTIC = (3.4445, -4.7750, 2.0315)
"""Newton-Schulz coefficients (a, b, c) of ``x -> a·x + b·x³ + c·x⁵`` tuned for speed: five steps
take every normalised singular value in [2e-3, 1] into [0.68, 1.21] rather than to exactly 1, which
Muon's authors found costs nothing measurable in training and needs far fewer steps than exact
convergence."""

CUBIC = (1.5, -0.5, 0.0)
"""The classical Newton-Schulz iteration for the polar factor: converges to exactly ``U Vᵀ`` for
singular values in (0, sqrt(3)), slowly for small ones."""

SCALE_MODES = ("spectral", "match_adamw")


def newton_schulz(matrix_AB: Tensor, steps: int = 5, coefficients: tuple[float, float, float] = QUINTIC,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> Tensor:
    """Approximate the orthogonal factor ``U Vᵀ`` of ``matrix_AB = U S Vᵀ`` with matmuls only.

    ``X`` starts as the matrix divided by its Frobenius norm (so every singular value is <= 1);
    each step ``X <- a·X + (b·XXᵀ + c·(XXᵀ)²)·X`` keeps the singular vectors and maps every singular
    value through ``σ -> a·σ + b·σ³ + c·σ⁵``. The Gram matrix is taken on the short side. Computed
    in ``dtype`` (float32, or bfloat16 as Muon's authors run it; float64 input stays float64) and
    returned in the input's dtype.
    """
    if matrix_AB.ndim != 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(matrix_AB.shape)}")
    a, b, c = coefficients
    x = matrix_AB.to(torch.float64 if matrix_AB.dtype == torch.float64 else dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).to(matrix_AB.dtype)


def muon_scale(shape: torch.Size | tuple[int, ...], mode: str) -> float:
    """Size of the orthogonal step for a ``[rows, cols]`` weight (module docstring)."""
    rows, cols = shape
    if mode == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown Muon scale mode {mode!r} (expected one of {', '.join(SCALE_MODES)})")


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups with ``muon=True`` (2-D weights only), AdamW on the others.

    ``ns_dtype`` is the Newton-Schulz iterations' dtype (:func:`newton_schulz`): a setting of the run
    (``--muon-ns-dtype``, compared on resume like every flag), not a group key, so checkpoints written
    before it existed load as they are. Muon group keys: ``lr``, ``momentum``, ``nesterov``, ``ns_steps``, ``scale_mode``,
    ``weight_decay`` (decoupled, like AdamW's). AdamW group keys: ``lr``, ``betas``, ``eps``,
    ``weight_decay``. State per parameter: ``momentum_buffer`` (Muon) or ``step``, ``exp_avg``,
    ``exp_avg_sq`` (AdamW, the same update as ``torch.optim.AdamW``), all tensors, so
    ``state_dict`` round-trips through ``torch.save`` / ``torch.load(weights_only=True)``.
    """

    def __init__(self, param_groups: Iterable[dict], *, lr: float = 2e-3, muon_lr: float = 0.02,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, scale_mode: str = "spectral",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 ns_dtype: torch.dtype = torch.float32):
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {', '.join(SCALE_MODES)}, got {scale_mode!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        groups = [dict(group, lr=group.get("lr", muon_lr if group.get("muon") else lr)) for group in param_groups]
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, scale_mode=scale_mode,
                        betas=betas, eps=eps, weight_decay=weight_decay, muon=False)
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon updates 2-D weights only; a muon=True group holds shapes "
                                 f"{[tuple(p.shape) for p in group['params'] if p.ndim != 2]}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if _is_dtensor(p):
                    raise NotImplementedError("MuonAdamW does not handle FSDP2-sharded (DTensor) parameters yet: "
                                              "Newton-Schulz needs each whole matrix")
                if group["muon"]:
                    self._muon_update(p, group)
                else:
                    self._adamw_update(p, group)
        return loss

    def _muon_update(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(p.grad)
        direction = p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        update = newton_schulz(direction, steps=group["ns_steps"], dtype=self.ns_dtype)
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * muon_scale(p.shape, group["scale_mode"]))

    def _adamw_update(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(p.grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
        bias1, bias2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)


def _is_dtensor(p: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(p, DTensor)


def is_muon_parameter(name: str, p: Tensor) -> bool:
    """The split of the module docstring: 2-D weights inside ``layers.*`` (names as in
    ``PEagleDraft.named_parameters()``, with any wrapper prefix already removed)."""
    return name.startswith("layers.") and p.ndim == 2


def muon_param_groups(draft: torch.nn.Module, *, muon_lr: float = 0.02, adamw_lr: float = 2e-3,
                      weight_decay: float = 0.01) -> list[dict]:
    """Param groups of a ``PEagleDraft`` for :class:`MuonAdamW`; frozen parameters are left out.

    Three groups: Muon matrices (decayed); AdamW matrices (``fc``, ``lm_head`` when trained:
    decayed); AdamW vectors and tables (norms, ``mask_hidden``, ``embed_tokens``: no decay, as in
    the trainer's AdamW, because shrinking them toward zero has no regularising meaning). Params
    are given as (name, parameter) pairs, so the optimizer's groups carry ``param_names`` (kept in
    its state dict) that say which rule a parameter got.
    """
    groups: dict[str, list[tuple[str, Tensor]]] = {"muon": [], "adamw_decay": [], "adamw_no_decay": []}
    for name, p in draft.named_parameters():
        if not p.requires_grad:
            continue
        if is_muon_parameter(name, p):
            key = "muon"
        elif p.ndim == 2 and not name.startswith("embed_tokens"):
            key = "adamw_decay"
        else:
            key = "adamw_no_decay"
        groups[key].append((name, p))
    settings = {"muon": dict(muon=True, lr=muon_lr, weight_decay=weight_decay),
                "adamw_decay": dict(muon=False, lr=adamw_lr, weight_decay=weight_decay),
                "adamw_no_decay": dict(muon=False, lr=adamw_lr, weight_decay=0.0)}
    return [{"params": named, **settings[key]} for key, named in groups.items() if named]
