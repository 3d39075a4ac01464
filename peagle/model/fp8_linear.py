"""``--fp8-matmuls``: the decoder layers' matmuls in fp8, through torchao's rowwise ``Float8Linear``.

Every q/k/v/o projection and MLP matmul of every decoder layer becomes a ``Float8Linear`` with
torchao's ``rowwise`` recipe: each operand is scaled per row (activations, gradients) or per output
row (weights) to e4m3 just before the matmul, dynamically, and the matmul runs on the fp8 units
(``torch._scaled_mm``; Hopper and later on CUDA, and torch's CPU kernel here). Master weights,
optimizer state, ``fc``, the embeddings, ``lm_head`` and attention stay as they are. The module
keeps its parameter (``weight``), so checkpoints and export do not change; under
``--compile layers`` the scalings fuse into the compiled layer.

torchao is an optional dependency (``pip install 'peagle[fp8]'``); the flag is refused in one line
without it, and for a draft whose matmul sizes are not multiples of 16 (what the fp8 matmul needs).
Default off: what it costs in acceptance is measured by benchmarks/quality.py (variant
``fp8-matmuls``), what it gains in speed by benchmarks/train_step.py on a GPU.
"""

from __future__ import annotations

from torch import nn

from peagle.schemas.errors import UserError

FP8_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The ``nn.Linear`` names (inside ``draft.layers``) that run in fp8."""

FP8_RECIPE = "rowwise"


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
    return before
