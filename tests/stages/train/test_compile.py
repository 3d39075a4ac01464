"""torch.compile in steady state: one compiled graph per region serves every COD length.

The trainer compiles each decoder layer whole, flex attention inside, and the loss's per-chunk pass
(``--compile layers``, regional_compile.py), or flex attention alone (``--compile flex``,
``FlexRunner(compile=True)``), always ``dynamic=True``.
Batches change their COD length N, their block counts and their document layout every step; if any
of that were baked into the graph, each new shape would recompile (the reference trainer pays
20-40 s per new COD length on an H100). Here the compiled flex *forward* (Inductor's CPU lowering;
flex has no CPU backward) runs the draft over real loader batches of a real store, with the
BlockMasks built from the indices the loader workers ship, and Dynamo's own counters must show at
most two compiles (the first graph, and at most one re-trace that marks sizes dynamic). Every
output must equal the eager draft's with SDPA on the dense mask (the reference implementation of
the rule), norms non-trivial so that a swapped or skipped norm would show: for ``--compile layers``
this is the check that flex attention traced inside a compiled decoder layer computes what eager
layers do (tests/model/test_regional_compile.py checks the compiled layers' training graphs).

The compiled layers are also trained here, through the real step over real loader batches: SDPA
on a dense mask (flex has no CPU backward), bf16 autocast as on the GPU, and the step's loss and
every gradient must equal the eager layers' within bf16 tolerance.

Also here: what the runner does when compiling fails (a compile function that fails on purpose).
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig

from peagle.model.draft import build_draft_from_target
from peagle.model.flex import FlexRunner
from peagle.model.regional_compile import DraftCompiler, compile_layers, uncompile_layers
from peagle.model.mask import block_mask_from_indices, dense_mask, peagle_mask_mod
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import StoreSpec, TrainConfig
from peagle.stages.train.batch import CodSettings
from peagle.stages.train.loader import LoaderConfig, TrainLoader
from peagle.stages.train.loop import Trainer
from peagle.testing.trainer import trainer_for_draft
from peagle.stages.train.step import compiled_graph_count
from peagle.testing.cod_masks import cod_block_mask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

NUM_BATCHES = 12


def _distinct_batches(tiny_store, attention: str) -> list:
    """Real loader batches of pairwise different COD lengths (flex: the workers ship block indices)."""
    config = LoaderConfig(stores=(StoreSpec(str(tiny_store.root)),), token_budget=160, attention=attention,
                          block_size=32, cod=CodSettings(num_depths=4), num_workers=1)
    loader = TrainLoader(config)
    batches, lengths = [], set()
    for epoch in range(4):
        for batch in loader.batches(epoch):
            if batch.num_elements not in lengths:
                lengths.add(batch.num_elements)
                batches.append(batch)
    assert len(batches) >= NUM_BATCHES, f"only {len(batches)} distinct COD lengths"
    return batches[:NUM_BATCHES]


@pytest.fixture(scope="module")
def flex_batches(tiny_store):
    return _distinct_batches(tiny_store, "flex")


def _draft(tiny_store):
    hf_config = AutoConfig.from_pretrained(tiny_store.target_dir)
    config = DraftConfig.from_target_config(hf_config, num_layers=2, mask_token_id=tiny_store.mask_token_id)
    torch.manual_seed(0)
    draft = build_draft_from_target(tiny_store.target_dir, config).eval()
    with torch.no_grad():  # non-trivial norms: a swapped or skipped norm would show
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return draft


def _forward(draft, batch, flex):
    """The draft's output on ``batch``: flex attention through ``flex`` on the BlockMask of the shipped
    indices, or (``flex`` None) the eager reference, SDPA on the dense mask."""
    (unit,) = batch.units
    if flex is None:
        mask = dense_mask(batch.anchor_N, batch.depth_N, batch.doc_N)
    else:
        mask = block_mask_from_indices(unit.block_indices, peagle_mask_mod(batch.anchor_N, batch.depth_N, batch.doc_N))
    return draft(batch.tokens_T, batch.aux_TAH, batch.position_ids_N, mask, flex)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flex", "layers"])
def test_compiled_flex_forward_compiles_at_most_twice_over_real_batches(tiny_store, flex_batches, mode):
    """``flex``: flex compiled alone (one region); ``layers``: both decoder layers compiled whole with
    the BlockMask passed in and flex traced inside (two regions: layer 0 and the other layer). Each
    output equals the eager layers' with SDPA on the dense mask."""
    draft = _draft(tiny_store)
    torch._dynamo.reset()  # nothing compiled by earlier tests may serve these calls
    compiler = DraftCompiler(draft.layers, mode=mode, attention="flex")
    before = compiled_graph_count()
    with torch.no_grad():
        outputs = [_forward(draft, batch, compiler.flex) for batch in flex_batches]
    compiles = compiled_graph_count() - before
    uncompile_layers(draft.layers)
    with torch.no_grad():
        eager = [_forward(draft, batch, None) for batch in flex_batches]
    if mode == "flex":
        assert compiler.flex.compiled and compiler.flex.compile_error is None
    regions = 1 if mode == "flex" else 2
    assert 1 <= compiles <= 2 * regions, f"{compiles} graphs compiled over {len(flex_batches)} COD lengths"
    for got, want in zip(outputs, eager, strict=True):  # and the compiled code computes what eager layers do
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _trainer(tiny_store, compile: str) -> Trainer:
    config = TrainConfig.from_flags(store=(str(tiny_store.root),), target=str(tiny_store.target_dir), out="unused",
                                    num_depths=4, attention="sdpa", compile=compile, max_steps=10, lr=1e-3,
                                    warmup_steps=0, optimizer="adamw")
    return trainer_for_draft(config, _draft(tiny_store).train(), compute_dtype=torch.bfloat16)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones_and_compile_at_most_twice_over_real_batches(tiny_store):
    batches = _distinct_batches(tiny_store, "sdpa")
    eager, compiled = _trainer(tiny_store, "off"), _trainer(tiny_store, "layers")
    assert compiled.step_fn.compiler.mode == "layers" and eager.step_fn.compiler.mode == "off"
    assert "decoder layers compiled whole" in compiled.step_fn.describe()
    torch._dynamo.reset()
    start, graphs = compiled_graph_count(), []
    for i, batch in enumerate(batches):
        compiled.step_fn.optimizer.zero_grad(set_to_none=True)
        stats, (count, _, _) = compiled.step_fn.forward_backward([batch])
        graphs.append(compiled_graph_count() - start)
        if i < 2:  # the same loss and gradients as the eager layers (bf16 autocast: bf16 tolerance)
            eager.step_fn.optimizer.zero_grad(set_to_none=True)
            want, _ = eager.step_fn.forward_backward([batch])
            assert float(stats.loss_sum) == pytest.approx(float(want.loss_sum), rel=2e-2)
            torch.testing.assert_close(stats.depth_count, want.depth_count)
            for (name, p), q in zip(compiled.draft.named_parameters(), eager.draft.parameters()):
                if q.grad is not None:
                    assert _relative(p.grad, q.grad) < 5e-2, name
    # Three regions (layer 0, the other layers' shared code, the loss chunk): at most two graphs each,
    # and none after the second batch.
    assert graphs[-1] <= 6 and graphs[-1] == graphs[1], graphs


def _failing_compile(error: Exception):
    def compile_fn(fn, **kwargs):
        def compiled(*args, **kw):
            raise error
        return compiled
    return compile_fn


class _BackwardFails(torch.autograd.Function):
    """Identity forward; a backward that fails as torch 2.11's compiled RMSNorm backward did on an H100."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("shape '[513, 4096]' is invalid for input of size 1")


def _compiled_with_a_failing_backward(fn, **kwargs):
    def compiled(*args, **kw):
        return _BackwardFails.apply(fn(*args, **kw))
    return compiled


def test_a_failing_backward_of_the_compiled_layers_falls_back_and_redoes_the_step(tiny_store, caplog):
    """The first GPU run of ``--compile layers`` died in the backward with a run-time error of
    Inductor's code (not a compile error). Such a step is redone with the layers eager (flex compiled
    alone): its loss and gradients are exactly the eager trainer's, none counted twice."""
    config = LoaderConfig(stores=(StoreSpec(str(tiny_store.root)),), token_budget=160, attention="sdpa",
                          block_size=32, cod=CodSettings(num_depths=4), num_workers=1)
    batch = next(iter(TrainLoader(config).batches(0)))
    eager, compiled = _trainer(tiny_store, "off"), _trainer(tiny_store, "layers")
    compiler = compiled.step_fn.compiler
    uncompile_layers(compiler.layers)
    compile_layers(compiler.layers, _compiled_with_a_failing_backward)
    compiler.loss_chunk = None
    with caplog.at_level(logging.WARNING, logger="peagle.model.regional_compile"):
        got, (count, _, _) = compiled.step_fn.forward_backward([batch])
    want, (want_count, _, _) = eager.step_fn.forward_backward([batch])
    assert "failed in the backward" in caplog.text and "[513, 4096]" in compiled.step_fn.describe()
    assert compiler.mode == "flex" and count == want_count
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=0, atol=0)
    for (name, p), q in zip(compiled.draft.named_parameters(), eager.draft.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def _qkv_and_mask(num_elements: int, num_heads: int = 4):
    anchor = torch.arange(num_elements)
    depth = torch.zeros(num_elements, dtype=torch.long)
    lengths = torch.tensor([num_elements])
    mask = cod_block_mask(anchor, depth, lengths, num_elements, block_size=32)
    q = torch.randn(1, num_heads, num_elements, 16)
    k = v = torch.randn(1, 2, num_elements, 16)
    return q, k, v, mask


def test_a_compile_failure_on_a_small_row_falls_back_to_eager_and_logs_it(caplog):
    from torch._dynamo.exc import TorchRuntimeError

    runner = FlexRunner(compile=True, compile_fn=_failing_compile(TorchRuntimeError("triton: no kernel config fits")))
    q, k, v, mask = _qkv_and_mask(64)
    with caplog.at_level(logging.WARNING, logger="peagle.model.flex"):
        out = runner(q, k, v, block_mask=mask)
    assert not runner.compiled and "no kernel config fits" in runner.compile_error
    assert "eager flex_attention from now on" in caplog.text
    from torch.nn.attention.flex_attention import flex_attention
    torch.testing.assert_close(out, flex_attention(q, k, v, block_mask=mask, enable_gqa=True))


def test_a_compile_failure_on_a_big_row_stops_with_one_line():
    from torch._inductor.exc import InductorError

    runner = FlexRunner(compile=True, max_eager_score_bytes=4 * 4 * 100 * 100,
                        compile_fn=_failing_compile(InductorError(RuntimeError("lowering\nfailed"), "tb")))
    q, k, v, mask = _qkv_and_mask(128)
    with pytest.raises(UserError) as err:
        runner(q, k, v, block_mask=mask)
    line = str(err.value)
    assert "\n" not in line and "torch.compile failed on cpu" in line and "[4, 128, 128] scores" in line
    assert "--attention sdpa" in line
    # A later, bigger row after an eager fallback on a small one is refused the same way.
    small_q, small_k, small_v, small_mask = _qkv_and_mask(64)
    runner(small_q, small_k, small_v, block_mask=small_mask)
    with pytest.raises(UserError, match="would materialise"):
        runner(q, k, v, block_mask=mask)


def test_out_of_memory_is_not_taken_for_a_compile_failure():
    runner = FlexRunner(compile=True, compile_fn=_failing_compile(torch.OutOfMemoryError("CUDA out of memory")))
    q, k, v, mask = _qkv_and_mask(64)
    with pytest.raises(torch.OutOfMemoryError):
        runner(q, k, v, block_mask=mask)
    assert runner.compiled  # still compiled: an OOM says nothing about the compiler
