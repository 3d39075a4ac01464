"""What a training run compiles, decided once per run: each decoder layer whole, flex attention inside.

Three modes (``--compile``):

* ``layers`` (the default on CUDA): regional compilation, as torchtitan does it. Each decoder layer's
  ``forward`` (and ``step``, EAGLE-3's sequential form) is compiled whole (``dynamic=True``: one graph serves every COD length), with flex
  attention traced inside it, so Inductor fuses what runs eagerly otherwise: RMSNorm with its fp32
  promotion, RoPE (written straight into the contiguous layout flex reads), SiLU·mul, the residual
  adds and the casts around them. The layers share their code, so Dynamo compiles one graph per
  layer class (layer 0 and the others), whatever the layer count. The loss's per-chunk pass
  (``loss.fused_chunk_loss``) is compiled too. Module structure and parameter names do not change
  (the compiled ``forward`` is an instance attribute), so checkpoints and export are unaffected.
* ``flex``: flex attention compiled alone (:class:`FlexRunner`), everything else eager: the fallback
  when compiling a layer fails, and the A/B baseline.
* ``off``: nothing compiled (the default off CUDA; flex, if asked for, runs eager).

Every graph compiles with :func:`inductor_options` (one Inductor feature off, for a torch bug).
A compile failure of a layer is not the end of a run: :meth:`DraftCompiler.fall_back` uncompiles the
layers, logs one line with the reason, and the step reruns the unit with flex compiled alone (whose
own failures :class:`FlexRunner` handles). A failure while the compiled layers' backward runs does
the same, and the step is redone from its start (one process only; under DDP/FSDP2 the ranks'
gradient hooks have already fired, so it is raised). Backward graphs are lowered together with the forward
ones (``eager_backward_lowering``, entered by the step around each forward), so a failure to compile
a backward surfaces there too, not inside ``loss.backward()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from peagle.model.flex import (FlexFn, FlexRunner, eager_backward_lowering, is_compile_failure,
                               is_out_of_memory)
from peagle.schemas.errors import one_line

logger = logging.getLogger(__name__)


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """``auto`` is ``layers`` on CUDA and ``off`` elsewhere (a CPU run gains little and pays the compile)."""
    if mode == "auto":
        return "layers" if device.type == "cuda" else "off"
    return mode


WANTED_INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}
"""Inductor options of every graph this module compiles. Mix-order reduction (torch 2.11's fused
row-and-column reductions, e.g. RMSNorm's backward) is off: with ``dynamic=True`` its generated
code slices its workspace without parentheses around the symbolic split count
(``ws[0*1 + (s//16)*4096 : 1*1 + (s//16)*4096].view(1 + s//16, 4096)``), and the backward dies with
``shape '[513, 4096]' is invalid for input of size 1`` at 8k-token rows on an H100 (2k rows choose
another kernel and pass). benchmarks/results/gpu/2026-11-26-h100/NOTES.md has the failure, 2026-11-27-h200/ the
workaround working at L = 8192; drop this once torch fixes it."""


def inductor_options() -> dict[str, Any]:
    """``WANTED_INDUCTOR_OPTIONS`` that this torch knows: ``torch.compile`` refuses an unknown option
    outright, and a torch without mix-order reduction has nothing to turn off."""
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    return {key: value for key, value in WANTED_INDUCTOR_OPTIONS.items() if key in known}


COMPILED_METHODS = ("forward", "step")
"""The layer methods a run calls: ``forward`` (P-EAGLE's one forward) and ``step`` (EAGLE-3's
sequential steps over a key/value cache). Each compiles on its first call only, so a run compiles
the one its method uses."""


def compile_layers(layers: nn.ModuleList, compile_fn: Callable[..., Any] = torch.compile) -> None:
    """Compile each layer's ``forward`` and ``step`` whole, in place (instance attributes over the
    class's methods).

    Compiling ``forward`` rather than the module call keeps hooks (DDP, FSDP2, activation
    checkpointing's) outside the graph, where they run as they always do.
    """
    for layer in layers:
        for name in COMPILED_METHODS:
            setattr(layer, name, compile_fn(getattr(layer, name), dynamic=True, options=inductor_options()))


def uncompile_layers(layers: nn.ModuleList) -> None:
    """Undo :func:`compile_layers`: the class's eager methods again."""
    for layer in layers:
        for name in COMPILED_METHODS:
            layer.__dict__.pop(name, None)


class DraftCompiler:
    """The compile decision of one run (module docstring) and what the step passes the draft and the loss.

    ``flex`` is the attention function the draft gets (None: eager ``flex_attention`` or SDPA);
    ``loss_chunk`` the loss's per-chunk function (None: the eager one). ``compile_fn`` is how things
    get compiled (``torch.compile`` unless a test injects a failing one).
    """

    def __init__(self, layers: nn.ModuleList, *, mode: str, attention: str,
                 kernel_options: dict[str, Any] | None = None, compile_fn: Callable[..., Any] = torch.compile,
                 loss_chunk: Callable[..., Any] | None = None):
        if mode not in ("layers", "flex", "off"):
            raise ValueError(f"compile mode must be layers, flex or off (resolve auto first), got {mode!r}")
        self.layers, self.attention, self.compile_fn = layers, attention, compile_fn
        self.kernel_options = dict(kernel_options or {}) or None
        self.mode = mode
        self.fallback_reason: str | None = None
        self._eager_loss_chunk = loss_chunk
        self.flex: FlexFn | None = None
        self.loss_chunk: Callable[..., Any] | None = None
        self._apply()

    def _apply(self) -> None:
        flex_wanted = self.attention == "flex"
        if self.mode == "layers":
            compile_layers(self.layers, self.compile_fn)
            self.flex = (functools.partial(flex_attention, kernel_options=self.kernel_options)
                         if flex_wanted else None)
            self.loss_chunk = (self.compile_fn(self._eager_loss_chunk, dynamic=True, options=inductor_options())
                               if self._eager_loss_chunk is not None else None)
        else:
            self.flex = (FlexRunner(compile=self.mode == "flex", compile_fn=self.compile_fn,
                                    kernel_options=self.kernel_options) if flex_wanted else None)
            self.loss_chunk = None

    def describe(self) -> str:
        what = {"layers": "decoder layers compiled whole", "flex": "flex attention compiled alone",
                "off": "eager"}[self.mode]
        if self.mode == "off" and isinstance(self.flex, FlexRunner) and self.flex.compiled:
            what = "flex attention compiled alone"
        if self.kernel_options:
            what += f", flex kernel options {self.kernel_options}"
        return what + (f" (compiled layers failed: {self.fallback_reason})" if self.fallback_reason else "")

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Entered around each forward: backward graphs compile with the forward ones."""
        return eager_backward_lowering() if self.mode == "layers" else contextlib.nullcontext()

    def fall_back(self, err: BaseException, *, in_backward: bool = False) -> bool:
        """After ``err``: True (and flex compiled alone from now on) when the compiled layers are to blame;
        False when the caller must raise it.

        In a forward only a compile failure qualifies. In a backward (``in_backward``) any error but
        out-of-memory does: the compiled layers' backward runs Inductor-generated code, whose failures
        are run-time errors, not compile errors (torch 2.11's mix-order reduction bug, see
        ``WANTED_INDUCTOR_OPTIONS``, raised a plain ``RuntimeError`` there). The caller redoes the step
        eagerly, so an error that is not the compiler's is raised again from eager code.
        """
        if self.mode != "layers":
            return False
        if not (is_compile_failure(err) or (in_backward and not is_out_of_memory(err))):
            return False
        uncompile_layers(self.layers)
        self.mode, self.fallback_reason = "flex", one_line(err)
        self._apply()
        logger.warning("the compiled decoder layers failed%s (%s); training on with flex attention "
                       "compiled alone (--compile flex)", " in the backward" if in_backward else " to compile",
                       self.fallback_reason)
        return True
