"""Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX).

Two defaults hang on it: ``peagle train`` autocasts to bf16 there (1.19x, same acceptance:
benchmarks/results/cpu/train_precision.json) and ``peagle extract --regenerate`` writes its answers
in bf16 there (~1.5x, same acceptance: generation_dtype_acceptance.json). Elsewhere a CPU emulates
bf16 slowly, and float32 stays.
"""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
