"""flex_attention as a run uses it: compiled by Inductor, or eager where that is sane.

Eager ``flex_attention`` materialises the whole ``[heads, N, N]`` score matrix: fine for a test
row, hundreds of GiB at a training batch (N ≈ 55k COD elements at the default token budget). So
a :class:`FlexRunner` that was asked to compile never turns a compile failure into an eager run of a
big row: it stops the run with one line saying why (:class:`UserError`). Only where the scores of
the failing row fit in ``max_eager_score_bytes`` does it switch to eager, and it logs that.

Backward graphs are compiled when the forward is (``force_non_lazy_backward_lowering``), so a
failure to compile the backward surfaces at the forward call and is handled the same way, instead
of deep inside ``loss.backward()``. Out-of-memory errors are never taken for compile failures:
they propagate unchanged (the caller turns them into advice).

Who compiles is the owner's decision (the trainer, once per run): there is no module-level runner.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from peagle.schemas.errors import UserError, one_line

logger = logging.getLogger(__name__)

FlexFn = Callable[..., Tensor]
"""``fn(q, k, v, block_mask=..., enable_gqa=True) -> out``: eager ``flex_attention`` or a FlexRunner."""

FLEX_KERNEL_OPTIONS: dict[str, dict[str, Any]] = {
    "auto": {},
    "rows-safe": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"ROWS_GUARANTEED_SAFE": True, "USE_TMA": True},
    "flash": {"BACKEND": "FLASH"},
}
"""``--flex-kernel``: named ``kernel_options`` of flex attention (keys: ``schemas.train_config.FLEX_KERNELS``).

``auto`` is torch's own choice. ``rows-safe`` tells the kernels that every query row sees at least one
key, which holds for every training row (an element always sees itself; training rows carry no
padding), so they skip the fully-masked-row guards. ``tma`` adds Hopper's bulk tensor copies.
``flash`` is the FlashAttention-4 (CuTe DSL) backend, where torch exposes it and ``flash_attn.cute``
is installed. benchmarks/attention.py times these and more block-size choices on the P-EAGLE mask;
the default moves only on such a measurement."""

DEFAULT_MAX_EAGER_SCORE_BYTES = 2 << 30
"""Eager fallback only while one row's fp32 scores ``[heads, N, N]`` stay under 2 GiB (N ≈ 4k at 32 heads)."""


def compile_failure_types() -> tuple[type[BaseException], ...]:
    """The exception types torch raises when Dynamo/Inductor cannot compile (not when a kernel runs)."""
    types: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError, TorchRuntimeError

        types += [BackendCompilerFailed, InternalTorchDynamoError, TorchRuntimeError]
    with contextlib.suppress(ImportError):
        from torch._inductor.exc import InductorError, LoweringException

        types += [InductorError, LoweringException]
    return tuple(types)


def is_out_of_memory(err: BaseException) -> bool:
    """An allocator's out-of-memory, also where a compiled kernel's launch re-raised it as another type."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def is_compile_failure(err: BaseException) -> bool:
    """True for a Dynamo/Inductor compile error, False for an out-of-memory or any other error."""
    if is_out_of_memory(err):
        return False
    return isinstance(err, compile_failure_types())


def eager_backward_lowering() -> contextlib.AbstractContextManager:
    """Compile backward graphs together with forward ones (a torch config, patched only around our calls)."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return functorch_config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


class FlexRunner:
    """Runs flex_attention for one owner, compiled (``compile=True``) or eager.

    ``compile_fn`` is how the function gets compiled (``torch.compile`` unless a test injects a
    failing one); with ``dynamic=True`` one graph serves every COD length (tests/stages/train/
    test_compile.py holds it to at most two compiles over real loader batches).
    """

    def __init__(self, *, compile: bool, max_eager_score_bytes: int = DEFAULT_MAX_EAGER_SCORE_BYTES,
                 compile_fn: Callable[..., FlexFn] = torch.compile, kernel_options: dict[str, Any] | None = None):
        self.max_eager_score_bytes = max_eager_score_bytes
        self.kernel_options = kernel_options or None
        self._compiled: FlexFn | None = compile_fn(flex_attention, dynamic=True) if compile else None
        self.compile_error: str | None = None  # set when a compile failure switched this runner to eager

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, block_mask: BlockMask, enable_gqa: bool = True) -> Tensor:
        if self._compiled is not None:
            try:
                with eager_backward_lowering():
                    return self._compiled(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa,
                                          kernel_options=self.kernel_options)
            except Exception as err:  # noqa: BLE001 - sorted below: only compile failures are handled
                if not is_compile_failure(err):
                    raise
                self._compiled, self.compile_error = None, one_line(err)
                self._check_eager_fits(q, err)
                logger.warning("flex attention: torch.compile failed on %s (%s); eager flex_attention from now "
                               "on, for rows whose scores fit %.1f GiB", q.device.type, self.compile_error,
                               self.max_eager_score_bytes / 2**30)
        elif self.compile_error is not None:
            self._check_eager_fits(q, None)
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)  # eager: no kernel options

    def _check_eager_fits(self, q: Tensor, err: BaseException | None) -> None:
        """Raise UserError when this row's eager scores exceed the limit (after a compile failure)."""
        num_heads, num_elements = q.shape[-3], q.shape[-2]
        score_bytes = 4 * num_heads * num_elements * num_elements
        if score_bytes > self.max_eager_score_bytes:
            raise UserError(
                f"flex attention: torch.compile failed on {q.device.type} ({self.compile_error}); eager "
                f"flex_attention would materialise [{num_heads}, {num_elements}, {num_elements}] scores "
                f"({score_bytes / 2**30:.1f} GiB) for this batch, so training stops here. Fix the compile "
                f"(TORCH_LOGS=+inductor shows why) or train with --attention sdpa") from err
