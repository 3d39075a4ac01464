"""Muon + AdamW (peagle.stages.train.muon): Newton-Schulz against SVD, the AdamW path against
torch's AdamW, the param split on a real PEagleDraft, descent on a toy problem, exact resume."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.model.draft import PEagleDraft
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError
from peagle.schemas.optimizer_settings import OptimizerSettings
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.muon import CUBIC, QUINTIC, MuonAdamW, muon_param_groups, muon_scale, newton_schulz
sys.path.insert(0, str(Path(__file__).parent))  # sibling test helpers (test_loop), whatever pytest's import mode


def tiny_draft(num_layers: int = 2, train_lm_head: bool = False, seed: int = 0) -> PEagleDraft:
    config = DraftConfig(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=48,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         num_layers=num_layers, target_hidden_size=32, num_aux=3, target_vocab_size=64,
                         draft_vocab_size=64, mask_token_id=63, max_position_embeddings=128, aux_layer_ids=[2, 4, 5])
    torch.manual_seed(seed)
    return PEagleDraft(config, train_lm_head=train_lm_head)


def svd_reference(matrix: torch.Tensor, steps: int, coefficients, eps: float = 1e-7) -> torch.Tensor:
    """What Newton-Schulz must compute, by SVD: same singular vectors, every normalised singular
    value pushed ``steps`` times through the scalar polynomial a·s + b·s³ + c·s⁵."""
    a, b, c = coefficients
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    s = s / (torch.linalg.matrix_norm(matrix.double()) + eps)
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vh


@settings(max_examples=60)
@given(st.integers(1, 24), st.integers(1, 24), st.integers(0, 2**31), st.sampled_from([1, 3, 5]),
       st.sampled_from([QUINTIC, CUBIC]))
def test_newton_schulz_equals_svd_reference(rows: int, cols: int, seed: int, steps: int, coefficients) -> None:
    g = torch.Generator().manual_seed(seed)
    matrix = torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.rand((), generator=g, dtype=torch.float64) * 10
    out = newton_schulz(matrix, steps=steps, coefficients=coefficients)
    assert out.shape == matrix.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, svd_reference(matrix, steps, coefficients), atol=1e-9, rtol=1e-9)


def test_cubic_iteration_converges_to_the_polar_factor() -> None:
    """Enough classical steps on a well-conditioned matrix give exactly U Vᵀ (the nearest orthogonal matrix)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(16, 16), (8, 24), (24, 8)]:
        u, _ = torch.linalg.qr(torch.randn(max(shape), max(shape), generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(min(shape), min(shape), generator=g, dtype=torch.float64))
        s = torch.linspace(1.0, 8.0, min(shape), dtype=torch.float64)  # condition number 8
        left = u[:, : min(shape)] if shape[0] >= shape[1] else v
        right = v if shape[0] >= shape[1] else u[:, : min(shape)]
        matrix = left @ torch.diag(s) @ right.T
        assert matrix.shape == shape
        out = newton_schulz(matrix, steps=60, coefficients=CUBIC)
        torch.testing.assert_close(out, left @ right.T, atol=1e-10, rtol=0)


def test_quintic_five_steps_lands_singular_values_in_the_documented_band() -> None:
    g = torch.Generator().manual_seed(1)
    for shape in [(32, 96), (128, 48), (16, 64)]:
        matrix = torch.randn(*shape, generator=g)
        normalised = torch.linalg.svdvals(matrix.double()) / torch.linalg.matrix_norm(matrix.double())
        assert float(normalised.min()) >= 2e-3  # the band's premise holds for these Gaussian matrices
        sv = torch.linalg.svdvals(newton_schulz(matrix).double())
        assert 0.68 <= float(sv.min()) and float(sv.max()) <= 1.21


def test_float32_input_is_computed_in_float32_and_close_to_float64() -> None:
    matrix = torch.randn(40, 24, generator=torch.Generator().manual_seed(2))
    out = newton_schulz(matrix)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), newton_schulz(matrix.double()), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(3, 4, 5))


def test_bfloat16_iterations_land_in_the_band_and_return_the_input_dtype() -> None:
    """--muon-ns-dtype bfloat16: the iterations in bf16 (Muon's authors' choice) still take the
    singular values near 1, within a few % of float32's result, and hand back float32."""
    g = torch.Generator().manual_seed(3)
    for shape in [(64, 192), (192, 64)]:
        matrix = torch.randn(*shape, generator=g)
        out = newton_schulz(matrix, dtype=torch.bfloat16)
        assert out.dtype == torch.float32
        sv = torch.linalg.svdvals(out.double())
        assert 0.6 <= float(sv.min()) and float(sv.max()) <= 1.3
        reference = newton_schulz(matrix)
        assert 1e-4 < float((out - reference).norm() / reference.norm()) < 0.05  # bf16 did run, and stayed close


def test_build_optimizer_runs_newton_schulz_in_the_configured_dtype(monkeypatch) -> None:
    from peagle.stages.train import muon
    from peagle.stages.train.optim import build_optimizer

    seen = []
    real = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda m, **kw: seen.append(kw["dtype"]) or real(m, **kw))
    draft = tiny_draft()
    for dtype in ("float32", "bfloat16"):
        opt = build_optimizer(draft, OptimizerSettings(muon_ns_dtype=dtype), torch.device("cpu"))
        for p in draft.parameters():
            p.grad = torch.ones_like(p) if p.requires_grad else None
        opt.step()
    assert {d for d in seen} == {torch.float32, torch.bfloat16} and seen[0] == torch.float32 and seen[-1] == torch.bfloat16
    with pytest.raises(UserError, match="--muon-ns-dtype must be one of float32|bfloat16, got 'float16'"):
        TrainConfig.from_flags(store=("s",), target="t", out="o", muon_ns_dtype="float16")


def test_scale_modes() -> None:
    assert muon_scale((64, 16), "spectral") == 2.0 and muon_scale((16, 64), "spectral") == 1.0
    assert muon_scale((16, 100), "match_adamw") == pytest.approx(2.0)
    with pytest.raises(ValueError, match="scale mode"):
        muon_scale((4, 4), "rms")


@pytest.mark.parametrize("train_lm_head", [False, True])
def test_param_groups_of_a_draft(train_lm_head: bool) -> None:
    draft = tiny_draft(num_layers=2, train_lm_head=train_lm_head)
    groups = MuonAdamW(muon_param_groups(draft, muon_lr=0.02, adamw_lr=1e-3, weight_decay=0.1)).param_groups
    named = {n for group in groups for n in group["param_names"]}
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert named == trainable and sum(len(g["param_names"]) for g in groups) == len(trainable)
    by_rule = {(g["muon"], g["weight_decay"]): set(g["param_names"]) for g in groups}
    projections = {f"layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    projections |= {f"layers.{i}.mlp.{m}.weight" for i in range(2) for m in ("gate_proj", "up_proj", "down_proj")}
    assert by_rule[(True, 0.1)] == projections
    assert by_rule[(False, 0.1)] == {"fc.weight"} | ({"lm_head.weight"} if train_lm_head else set())
    no_decay = by_rule[(False, 0.0)]
    assert {"embed_tokens.weight", "mask_hidden", "norm.weight", "layers.0.hidden_norm.weight"} <= no_decay
    assert all(n in {"embed_tokens.weight", "mask_hidden"} or n.endswith("norm.weight") for n in no_decay)
    assert {g["lr"] for g in groups if g["muon"]} == {0.02} and {g["lr"] for g in groups if not g["muon"]} == {1e-3}
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([{"params": [draft.mask_hidden], "muon": True}])


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_follow_the_orthogonalised_momentum(nesterov: bool) -> None:
    """Step 1: decoupled decay, then minus lr·scale·NS(gradient) (NS ignores the momentum's scale);
    step 2: the direction is g2 + μ·(μ·g1 + g2) with Nesterov, else the buffer μ·g1 + g2."""
    g = torch.Generator().manual_seed(7)
    weight = torch.nn.Parameter(torch.randn(12, 4, generator=g, dtype=torch.float64))
    start = weight.detach().clone()
    opt = MuonAdamW([{"params": [weight], "muon": True}], muon_lr=0.05, momentum=0.9, nesterov=nesterov,
                    weight_decay=0.1)
    g1, g2 = torch.randn(12, 4, generator=g, dtype=torch.float64), torch.randn(12, 4, generator=g, dtype=torch.float64)
    weight.grad = g1
    opt.step()
    expected = start * (1 - 0.05 * 0.1) - 0.05 * muon_scale((12, 4), "spectral") * newton_schulz(g1)
    torch.testing.assert_close(weight.detach(), expected, atol=1e-8, rtol=0)  # NS divides by norm + eps
    weight.grad = g2
    opt.step()
    direction = g2 + 0.9 * (0.9 * g1 + g2) if nesterov else 0.9 * g1 + g2
    expected = expected * (1 - 0.05 * 0.1) - 0.05 * 3**0.5 * newton_schulz(direction)
    torch.testing.assert_close(weight.detach(), expected, atol=1e-8, rtol=0)  # NS divides by norm + eps


def test_adamw_path_equals_torch_adamw() -> None:
    torch.manual_seed(3)
    ours_params = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(7))]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    ours = MuonAdamW([{"params": ours_params, "muon": False}], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    ref = torch.optim.AdamW(ref_params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, foreach=False)
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        for a, b in zip(ours_params, ref_params):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    for a, b in zip(ours_params, ref_params):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_muon_decreases_a_toy_regression_loss() -> None:
    """Two stacked matrices (Muon) and a gain vector (AdamW) fit a random linear map."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 16, generator=g)
    y = x @ torch.randn(16, 16, generator=g) / 4
    first, second = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False)
    gain = torch.nn.Parameter(torch.ones(16))
    opt = MuonAdamW([{"params": [first.weight, second.weight], "muon": True},
                     {"params": [gain], "muon": False}], lr=1e-2, muon_lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 200)  # every group from its own base rate

    def loss() -> torch.Tensor:
        return ((second(first(x)) * gain - y) ** 2).mean()

    initial = float(loss().detach())
    for _ in range(200):
        opt.zero_grad()
        loss().backward()
        opt.step()
        sched.step()
    assert float(loss().detach()) < 0.02 * initial
    assert [group["initial_lr"] for group in opt.param_groups] == [0.02, 1e-2]


def _random_grads(draft: PEagleDraft, g: torch.Generator) -> None:
    for p in draft.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)


def test_state_dict_round_trip_resumes_exactly() -> None:
    """Save after 3 steps (through bytes, loaded weights-only), resume in a fresh draft and
    optimizer: 3 more steps end bit-identical to 6 uninterrupted steps."""

    def make(seed: int) -> tuple[PEagleDraft, MuonAdamW]:
        draft = tiny_draft(seed=seed, train_lm_head=True)
        return draft, MuonAdamW(muon_param_groups(draft, muon_lr=0.02, adamw_lr=2e-3, weight_decay=0.01))

    straight, straight_opt = make(0)
    grads = torch.Generator().manual_seed(6)
    for _ in range(6):
        _random_grads(straight, grads)
        straight_opt.step()

    first, first_opt = make(0)
    grads = torch.Generator().manual_seed(6)
    for _ in range(3):
        _random_grads(first, grads)
        first_opt.step()
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_opt = make(1)  # other init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    assert resumed_opt.state_dict()["param_groups"] == first_opt.state_dict()["param_groups"]
    for _ in range(3):
        _random_grads(resumed, grads)
        resumed_opt.step()
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    kinds = {frozenset(s) for s in resumed_opt.state.values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}


# ------------------------------------------------------------------------------------------------
# Wired into the trainer: `peagle train --optimizer muon --muon-lr LR`


def test_build_optimizer_gives_muon_its_rate_and_the_schedule_keeps_the_ratio() -> None:
    from peagle.stages.train.optim import build_optimizer, lr_factor

    config = OptimizerSettings(optimizer="muon", muon_lr=0.05, lr=1e-3, weight_decay=0.1)
    draft = tiny_draft()
    opt = build_optimizer(draft, config, torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    assert {(g["muon"], g["lr"], g["weight_decay"]) for g in opt.param_groups} == {
        (True, 0.05, 0.1), (False, 1e-3, 0.1), (False, 1e-3, 0.0)}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 2, 10))
    for step in range(6):
        rates = {g["muon"]: g["lr"] for g in opt.param_groups}
        assert rates[True] == pytest.approx(0.05 * lr_factor(step, 2, 10))
        assert rates[True] / rates[False] == pytest.approx(50.0)
        opt.step()
        sched.step()
    adamw = build_optimizer(draft, OptimizerSettings(optimizer="adamw"), torch.device("cpu"))
    assert type(adamw) is torch.optim.AdamW


def test_config_refuses_muon_with_fsdp_and_unknown_choices() -> None:
    with pytest.raises(UserError, match="^--fsdp needs --optimizer adamw: Muon \\(the default optimizer\\)"):
        TrainConfig.from_flags(store=("s",), target="t", out="o", fsdp=True)  # the default optimizer is Muon
    with pytest.raises(UserError, match="--optimizer must be one of adamw|muon, got 'sgd'"):
        TrainConfig.from_flags(store=("s",), target="t", out="o", optimizer="sgd")
    with pytest.raises(UserError, match="--muon-lr must be > 0"):
        TrainConfig.from_flags(store=("s",), target="t", out="o", optimizer="muon", muon_lr=0.0)
    TrainConfig.from_flags(store=("s",), target="t", out="o", optimizer="adamw", fsdp=True)  # AdamW shards fine


def test_a_muon_run_resumes_exactly_from_a_mid_checkpoint(tmp_path, tiny_store) -> None:
    """4 steps straight vs killed after the step-2 checkpoint and re-run: the same metrics lines and
    bit-identical weights; the checkpoint holds Muon's momentum and AdamW's moments by parameter."""
    import json
    import shutil

    from peagle.pipeline import checkpoint_files as cf
    from peagle.stages.train import checkpoint as ckpt
    from peagle.stages.train.loop import run_training
    from peagle.stages.train.optim import lr_factor
    from test_loop import TIMING, metrics, run_config

    straight = tmp_path / "straight"
    run_training(run_config(tiny_store, straight, optimizer="muon", muon_lr=0.02))
    train = [r for r in metrics(straight) if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    assert [r["lr"] for r in train] == pytest.approx([2e-3 * lr_factor(s, 1, 4) for s in range(4)])  # --lr's

    state = ckpt.load_checkpoint(cf.latest_valid_checkpoint(straight))[ckpt.OPTIMIZER]
    groups = {g["muon"]: g for g in state["param_groups"]}
    assert groups[True]["initial_lr"] == 0.02 and groups[False]["initial_lr"] == 2e-3
    kinds = {name: frozenset(s) for name, s in state["state"].items()}
    assert kinds["layers.0.self_attn.q_proj.weight"] == {"momentum_buffer"}
    assert kinds["fc.weight"] == {"step", "exp_avg", "exp_avg_sq"}

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    run_training(run_config(tiny_store, resumed, optimizer="muon", muon_lr=0.02))
    assert metrics(resumed) == [r | ({} if r["kind"] == "eval" else {k: r2[k] for k in TIMING})
                                for r, r2 in zip(metrics(straight), metrics(resumed))]
    a = torch.load(straight / "checkpoints" / "step-00000004" / "model.pt")
    b = torch.load(resumed / "checkpoints" / "step-00000004" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    json.dumps(state["param_groups"])  # plain values: the checkpoint's optimizer part stays portable
