"""Regional compilation (peagle/model/regional_compile.py): compiled decoder layers compute what eager ones do.

On the CPU, Inductor's C++ backend compiles the same graphs the GPU run compiles for Triton: each
decoder layer whole, with its norms (fp32 promotion), RoPE, SiLU·mul, residuals and casts fused.
Training attention here is SDPA on a dense mask (flex has no CPU backward). Gradients included, fp32
and bf16 autocast, with and without activation checkpointing. Flex attention inside a compiled layer
is checked through its forward, which Inductor does lower on the CPU, in
tests/stages/train/test_compile.py (``test_compiled_flex_forward_compiles_at_most_twice_over_real_batches
[layers]``: a 2-layer draft with non-trivial norms over real batches, against eager SDPA on the dense mask).
"""

from __future__ import annotations

import logging

import pytest
import torch

from peagle.model.flex import FlexRunner
from peagle.model.mask import dense_peagle_mask
from peagle.model.regional_compile import DraftCompiler, compile_layers, resolve_compile_mode, uncompile_layers
from peagle.testing.tiny_draft import cod_row, random_draft, small_config

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def layers_compiled(layers) -> bool:
    """Whether every layer runs a compiled ``forward`` (``compile_layers`` sets one per instance)."""
    return all("forward" in layer.__dict__ for layer in layers)


def _row(lengths=(40, 33), num_depths=3, seed=0):
    anchor_N, depth_N, position_N = cod_row(list(lengths), num_depths=num_depths)
    num_real, n = int((depth_N == 0).sum()), anchor_N.numel()
    g = torch.Generator().manual_seed(seed)
    token_ids_N = torch.randint(0, 199, (n,), generator=g)
    token_ids_N[num_real:] = 199
    aux_RAH = torch.randn(num_real, 3, 64, generator=g)
    dense = dense_peagle_mask(anchor_N, depth_N, torch.tensor(lengths), sum(lengths))
    return token_ids_N, aux_RAH, position_N, dense


def _loss_and_grads(draft, inputs, autocast: bool):
    token_ids_N, aux_RAH, position_N, mask = inputs
    draft.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = draft.compute_logits(draft(token_ids_N, aux_RAH, position_N, mask))
    loss = out.float().square().mean()
    loss.backward()
    return out.float().detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("autocast,checkpointing", [(False, False), (True, False), (True, True)])
def test_compiled_layers_equal_eager_layers_with_gradients(autocast, checkpointing):
    torch._dynamo.reset()
    config = small_config(num_layers=2, norm_before_residual=True, fc_norm=True)
    eager = random_draft(config, activation_checkpointing=checkpointing)
    compiled = random_draft(config, activation_checkpointing=checkpointing)
    compile_layers(compiled.layers)
    assert layers_compiled(compiled.layers)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints and export unchanged
    token_ids_N, aux_RAH, position_N, dense = _row()
    want, want_grads = _loss_and_grads(eager, (token_ids_N, aux_RAH, position_N, dense), autocast)
    got, got_grads = _loss_and_grads(compiled, (token_ids_N, aux_RAH, position_N, dense), autocast)
    tolerance = 2e-2 if autocast else 1e-4  # bf16: different fusion, different roundings
    assert _relative(got, want) < tolerance
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 10
    for name, grad in want_grads.items():
        assert _relative(got_grads[name], grad) < 3 * tolerance, name
    uncompile_layers(compiled.layers)
    assert not layers_compiled(compiled.layers)


def _failing_compile(error: Exception):
    def compile_fn(fn, **kwargs):
        def compiled(*args, **kw):
            raise error
        return compiled
    return compile_fn


def test_a_layer_compile_failure_falls_back_to_flex_compiled_alone(caplog):
    from torch._inductor.exc import InductorError

    draft = random_draft(small_config(num_layers=2))
    compiler = DraftCompiler(draft.layers, mode="layers", attention="flex",
                             compile_fn=_failing_compile(InductorError(RuntimeError("no\nconfig"), "tb")))
    assert layers_compiled(draft.layers) and compiler.mode == "layers"
    token_ids_N, aux_RAH, position_N, dense = _row()
    with pytest.raises(InductorError) as err:
        draft(token_ids_N, aux_RAH, position_N, dense, compiler.flex)
    with caplog.at_level(logging.WARNING, logger="peagle.model.regional_compile"):
        assert compiler.fall_back(err.value)
    assert compiler.mode == "flex" and not layers_compiled(draft.layers)
    assert isinstance(compiler.flex, FlexRunner) and "no config" in compiler.fallback_reason
    assert "training on with flex attention compiled alone" in caplog.text
    assert "compiled layers failed" in compiler.describe()
    # Out of memory, any other error, or a failure outside the layers mode: the caller raises it.
    assert not compiler.fall_back(InductorError(RuntimeError("again"), "tb"))
    other = DraftCompiler(draft.layers, mode="layers", attention="sdpa")
    assert not other.fall_back(torch.OutOfMemoryError("CUDA out of memory"))
    assert not other.fall_back(ValueError("a bug"))
    # In a backward any error of the compiled layers but out-of-memory is theirs (the step redoes it eagerly).
    assert not other.fall_back(torch.OutOfMemoryError("CUDA out of memory"), in_backward=True)
    assert other.fall_back(RuntimeError("shape '[513, 4096]' is invalid"), in_backward=True)
    assert other.mode == "flex" and "[513, 4096]" in other.fallback_reason


def test_inductor_options_turn_off_mix_order_reduction_and_only_name_options_this_torch_knows(monkeypatch):
    """torch 2.11's mix-order reduction broke the compiled backward at 8k rows on an H100; a torch
    without the option must not be handed it (torch.compile refuses unknown options outright)."""
    from peagle.model import regional_compile

    assert regional_compile.inductor_options() == {"triton.mix_order_reduction": False}
    monkeypatch.setitem(regional_compile.WANTED_INDUCTOR_OPTIONS, "triton.no_such_option", True)
    options = regional_compile.inductor_options()
    assert options == {"triton.mix_order_reduction": False}
    torch.compile(lambda x: x + 1, options=options)  # accepted (an unknown key raises here)
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        torch.compile(lambda x: x + 1, options=dict(regional_compile.WANTED_INDUCTOR_OPTIONS))


def test_compile_mode_choices_need_no_gpu():
    assert resolve_compile_mode("auto", torch.device("cuda", 0)) == "layers"
    assert resolve_compile_mode("auto", torch.device("cpu")) == "off"
    assert resolve_compile_mode("flex", torch.device("cpu")) == "flex"
    draft = random_draft(small_config(num_layers=1))
    off = DraftCompiler(draft.layers, mode="off", attention="flex")
    assert isinstance(off.flex, FlexRunner) and not off.flex.compiled and not layers_compiled(draft.layers)
    assert off.loss_chunk is None and DraftCompiler(draft.layers, mode="off", attention="sdpa").flex is None
    with pytest.raises(ValueError, match="resolve auto first"):
        DraftCompiler(draft.layers, mode="auto", attention="sdpa")
