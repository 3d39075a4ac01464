"""``--fp8-matmuls`` (peagle/model/fp8_linear.py): torchao's rowwise Float8Linear in the decoder layers.

torchao runs on the CPU (``torch._scaled_mm`` has a CPU kernel), so where it is installed
(``pip install 'peagle[fp8]'``; not in the default environment, pyproject.toml says why) the
conversion is tested for real: which modules change, that names and checkpoints do not, and that the forward and every
gradient stay within fp8's error of the bf16 ones (e4m3 keeps 3 mantissa bits: a few percent),
eager and compiled. The CUDA path is tests/stages/train/test_cuda.py's.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch import nn

from peagle.model.fp8_linear import FP8_MODULES, convert_to_fp8_matmuls
from peagle.model.regional_compile import compile_layers
from peagle.schemas.errors import UserError
from peagle.testing.tiny_draft import cod_row, random_draft, small_config
from peagle.model.mask import dense_peagle_mask


def _inputs():
    anchor_N, depth_N, position_N = cod_row([24, 20], num_depths=3)
    num_real, n = int((depth_N == 0).sum()), anchor_N.numel()
    g = torch.Generator().manual_seed(0)
    token_ids_N = torch.randint(0, 199, (n,), generator=g)
    token_ids_N[num_real:] = 199
    mask = dense_peagle_mask(anchor_N, depth_N, torch.tensor([24, 20]), 44)
    return token_ids_N, torch.randn(num_real, 3, 64, generator=g), position_N, mask


def _run(draft, inputs):
    draft.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = draft.compute_logits(draft(*inputs)).float()
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def _relative(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fp8_layers_stay_within_fp8_error_of_bf16_with_gradients(compiled):
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'peagle[fp8]')")
    from torchao.float8.float8_linear import Float8Linear

    torch._dynamo.reset()
    config = small_config(num_layers=2)
    bf16, fp8 = random_draft(config), random_draft(config)
    assert convert_to_fp8_matmuls(fp8) == 2 * len(FP8_MODULES)
    swapped = {name.rsplit(".", 1)[-1] for name, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(FP8_MODULES) and not isinstance(fp8.fc, Float8Linear)
    assert not isinstance(fp8.lm_head, Float8Linear)
    assert fp8.state_dict().keys() == bf16.state_dict().keys()
    if compiled:
        compile_layers(fp8.layers)
    inputs = _inputs()
    want, want_grads = _run(bf16, inputs)
    got, got_grads = _run(fp8, inputs)
    assert 1e-4 < _relative(got, want) < 0.1  # fp8 really ran, and stayed close
    for name, grad in want_grads.items():
        assert _relative(got_grads[name], grad) < 0.15, name


def test_every_fp8_matmul_gets_sizes_cuda_accepts_whatever_the_row_count(monkeypatch):
    """CUDA's fp8 matmul needs every size to be a multiple of 16, the token count included (the
    first H100 run stopped at 27,618 COD rows); the CPU kernel does not, so the sizes are checked
    here at the call, for a row count that is not a multiple of 16, and the padding changes nothing."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'peagle[fp8]')")
    shapes = []
    scaled_mm = torch._scaled_mm

    def recording_scaled_mm(a, b, *args, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return scaled_mm(a, b, *args, **kwargs)

    draft = random_draft(small_config(num_layers=1))
    convert_to_fp8_matmuls(draft)
    inputs = _inputs()
    assert inputs[0].numel() % 16, "the row count must not already be a multiple of 16"
    with monkeypatch.context() as patch:
        patch.setattr(torch, "_scaled_mm", recording_scaled_mm)
        out, grads = _run(draft, inputs)
    assert len(shapes) == 3 * len(FP8_MODULES)  # forward, grad input, grad weight of each projection
    assert all(size % 16 == 0 for a, b in shapes for size in a + b), shapes
    assert out.shape[0] == inputs[0].numel() and all(g.isfinite().all() for g in grads.values())
    linear = draft.layers[0].mlp.down_proj
    x = torch.randn(2, 21, linear.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        padded_rows = linear(x)
        one_by_one = torch.cat([linear(x[:, i:i + 1]) for i in range(21)], dim=1)
    assert padded_rows.shape == (2, 21, linear.out_features)
    torch.testing.assert_close(padded_rows, one_by_one)  # rowwise scaling: a row's output is its own


def test_fp8_refuses_odd_sizes_and_a_missing_torchao_in_one_line(monkeypatch):
    if importlib.util.find_spec("torchao") is not None:
        draft = random_draft(small_config(num_layers=1, intermediate_size=100))
        with pytest.raises(UserError, match="multiples of 16.*100") as err:
            convert_to_fp8_matmuls(draft)
        assert "\n" not in str(err.value)
        assert not any(type(m).__name__ == "Float8Linear" for m in draft.modules())  # nothing half-converted
    draft = random_draft(small_config(num_layers=1))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"--fp8-matmuls needs torchao \(pip install 'peagle\[fp8\]'") as err:
        convert_to_fp8_matmuls(draft)
    assert "\n" not in str(err.value)
    assert all(type(m) is nn.Linear for m in draft.layers.modules() if isinstance(m, nn.Linear))
