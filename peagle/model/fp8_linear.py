"""``--fp8-matmuls``: the decoder layers' matmuls in fp8, through torchao's rowwise ``Float8Linear``.

Every q/k/v/o projection and MLP matmul of every decoder layer becomes a ``Float8Linear`` with
torchao's ``rowwise`` recipe: each operand is scaled per row (activations, gradients) or per output
row (weights) to e4m3 just before the matmul, dynamically, and the matmul runs on the fp8 units
(``torch._scaled_mm``; Hopper and later on CUDA, and torch's CPU kernel here). Master weights,
optimizer state, ``fc``, the embeddings, ``lm_head`` and attention stay as they are. The module
keeps its parameter (``weight``), so checkpoints and export do not change; under
``--compile layers`` the scalings fuse into the compiled layer.

CUDA's fp8 matmul also needs the token count to be a multiple of 16 (it is the contracted size of
the weight's gradient, ``grad_outᵀ @ x``), and a COD length is whatever the batch makes (27,618 in
the first H100 run, which stopped there). Each converted projection therefore pads its rows with
zeros to the next multiple of 16 and drops them after: a padded row's output is sliced away, so its
gradient is zero and adds nothing to the weight's (``pad_rows_to_16``).

torchao is an optional dependency (``pip install 'peagle[fp8]'``); the flag is refused in one line
without it, and for a draft whose matmul sizes are not multiples of 16 (what the fp8 matmul needs).
Default off: what it costs in acceptance is measured by benchmarks/quality.py (variant
``fp8-matmuls``), what it gains in speed by benchmarks/train_step.py on a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from peagle.schemas.errors import UserError

FP8_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The ``nn.Linear`` names (inside ``draft.layers``) that run in fp8."""

FP8_RECIPE = "rowwise"

ROW_MULTIPLE = 16
"""What CUDA's fp8 matmul (``torch._scaled_mm``) needs every operand size to be a multiple of."""


def pad_rows_to_16(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``forward`` over ``x`` ``[..., H]`` with its rows zero-padded to a multiple of 16, the padding dropped."""
    def padded(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        out = forward(F.pad(rows, (0, 0, 0, (-num_rows) % ROW_MULTIPLE)))[:num_rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return padded


def convert_to_fp8_matmuls(draft: nn.Module) -> int:
    """Swap the decoder layers' projections for torchao ``Float8Linear`` in place; returns how many.

    Raises:
        UserError: torchao is not installed, or a projection's sizes are not multiples of 16.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise UserError("--fp8-matmuls needs torchao (pip install 'peagle[fp8]', torchao 0.18); "
                        f"it could not be imported: {err}") from err
    for name, module in draft.layers.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in FP8_MODULES:
            if module.in_features % 16 or module.out_features % 16:
                raise UserError(f"--fp8-matmuls needs matmul sizes that are multiples of 16; layers.{name} is "
                                f"{module.in_features} -> {module.out_features}")

    def wanted(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in FP8_MODULES

    before = sum(1 for name, m in draft.layers.named_modules() if wanted(m, name))
    convert_to_float8_training(draft.layers, config=Float8LinearConfig.from_recipe_name(FP8_RECIPE),
                               module_filter_fn=wanted)
    for name, module in draft.layers.named_modules():
        if name.rsplit(".", 1)[-1] in FP8_MODULES:  # an instance attribute: names and checkpoints unchanged
            module.forward = pad_rows_to_16(module.forward)
    return before
