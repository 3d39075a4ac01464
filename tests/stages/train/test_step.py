"""The train step (step.py) on real loader batches: no host sync before the clip, one stats record.

**What the host-sync guard covers.** On a GPU, a step that reads a device value on the host
(``.item()``, ``int(t)``, ``.tolist()``, a boolean-mask index, ``nonzero``...) waits for every
kernel queued before it, so the CPU cannot run ahead and the GPU idles at each such point. On this
CPU there is no device to wait for, so the guard checks the *ops*: the step's forward+backward over
real loader batches (S = 1 and S = 2, SDPA; the flex forward in evaluation mode, around the flex kernel) runs under a
``TorchDispatchMode`` and a ``TorchFunctionMode`` that record every op which synchronises with the
host on CUDA: ``aten._local_scalar_dense`` (what item/int/float/bool call), ``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without an output size, ``bincount``,
``equal``/``is_nonzero``, indexing with a boolean mask, and ``.tolist()``/``.numpy()``/``.cpu()``.
Device-to-host copies as such cannot be told apart from CPU-to-CPU ones here; ``.cpu()``/``.tolist()``
are caught by name. The CUDA tests (tests/stages/train/test_cuda.py) run the real thing under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

from peagle.model.draft import build_draft_from_target
from peagle.model.mask import dense_peagle_mask
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.train_config import StoreSpec, TrainConfig
from peagle.stages.train.batch import CodSettings
from peagle.stages.train.loader import LoaderConfig, TrainLoader
from peagle.stages.train.loop import Trainer
from peagle.testing.trainer import trainer_for_draft
from peagle.stages.train.loss import LossStats
from peagle.stages.train.step import summarise

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
               "unique_consecutive", "unique_dim", "bincount", "equal", "is_nonzero", "masked_scatter",
               "masked_scatter_", "histc"}
SYNCING_METHODS = {"tolist", "numpy", "cpu", "item"}


class HostSyncRecorder(TorchDispatchMode):
    """Records ops that make a CUDA host wait (module docstring); the step runs unchanged."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.seen.append(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and func.__name__.endswith("Tensor"):
            self.seen.append("repeat_interleave without output_size")
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.seen.append(f"{name} with a boolean mask")
        return func(*args, **kwargs)


class HostReadRecorder(TorchFunctionMode):
    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCING_METHODS:
            self.seen.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


def record_host_syncs(fn) -> list[str]:
    ops = HostSyncRecorder()
    with HostReadRecorder(ops.seen), ops:
        fn()
    return ops.seen


def _loader(tiny_store, **kw) -> TrainLoader:
    config = LoaderConfig(stores=(StoreSpec(str(tiny_store.root)),), token_budget=200,
                          cod=CodSettings(num_depths=4), **kw)
    return TrainLoader(config)


def _trainer(tiny_store, **kw) -> Trainer:
    hf_config = AutoConfig.from_pretrained(tiny_store.target_dir)
    draft_config = DraftConfig.from_target_config(hf_config, num_layers=2, mask_token_id=tiny_store.mask_token_id)
    torch.manual_seed(0)
    draft = build_draft_from_target(tiny_store.target_dir, draft_config)
    config = TrainConfig.from_flags(store=(str(tiny_store.root),), target=str(tiny_store.target_dir), out="unused",
                                    num_depths=4, max_steps=10, lr=1e-3, warmup_steps=0, **kw)
    return trainer_for_draft(config, draft)


@pytest.mark.parametrize("partitions", [1, 2])
def test_forward_backward_runs_no_op_that_syncs_with_the_host(tiny_store, partitions):
    trainer = _trainer(tiny_store, sequence_partitions=partitions, attention="sdpa")
    trainer.step_fn.attention = "sdpa"  # one dense mask, as off the CPU (per document reads doc ids on the host)
    batches = list(_loader(tiny_store, sequence_partitions=partitions).batches(0))[:2]
    assert sum(len(b.units) for b in batches) == 2 * partitions
    result = {}
    seen = record_host_syncs(lambda: result.update(out=trainer.step_fn.forward_backward(batches)))
    assert seen == []
    stats, (count, tokens, _) = result["out"]
    assert count == sum(b.num_supervised for b in batches) and tokens == sum(b.num_tokens for b in batches)
    assert float(stats.depth_count.sum()) == count  # every supervised element charged exactly once
    assert all(p.grad is not None for p in trainer.draft.parameters() if p.requires_grad)


def opaque_flex(q, k, v, *, block_mask, enable_gqa=True):
    """flex_attention outside the recorders: one kernel on a GPU (and Dynamo refuses to trace
    under a user dispatch mode, which eager flex does too)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as outside:
        outside.enter_context(_disable_current_modes())
        if isinstance(_get_current_function_mode(), HostReadRecorder):
            outside.enter_context(_pop_mode_temporarily())
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def test_flex_evaluation_runs_no_op_that_syncs_with_the_host(tiny_store):
    """Everything around the flex kernel: the mask_mod closure, the BlockMask from shipped indices."""
    trainer = _trainer(tiny_store, attention="sdpa")
    trainer.step_fn.attention = "flex"  # evaluation only: flex has a CPU forward, no CPU backward
    trainer.step_fn.compiler.flex = opaque_flex
    batches = list(_loader(tiny_store, attention="flex", block_size=32).batches(0))[:2]
    result = {}
    seen = record_host_syncs(lambda: result.update(stats=trainer.step_fn.evaluate(batches)[0]))
    assert seen == []
    sdpa, _ = _trainer(tiny_store, attention="sdpa").step_fn.evaluate(list(_loader(tiny_store).batches(0))[:2])
    torch.testing.assert_close(result["stats"].to_vector(), sdpa.to_vector(), atol=1e-3, rtol=1e-4)
    assert float(sdpa.depth_count.sum()) > 0


def test_the_guard_sees_what_the_old_mask_path_did(tiny_store):
    """Not vacuous: building the mask from document lengths (host reads of lengths and anchors)
    and a boolean-mask index are both caught."""
    batch = next(iter(_loader(tiny_store).batches(0)))
    seen = record_host_syncs(lambda: dense_peagle_mask(batch.anchor_N, batch.depth_N, batch.doc_lengths_D,
                                                       batch.num_tokens))
    assert "_local_scalar_dense" in seen
    assert record_host_syncs(lambda: batch.anchor_N[batch.depth_N > 0]) == ["index with a boolean mask"]
    assert record_host_syncs(lambda: batch.depth_N.tolist()) == ["Tensor.tolist"]


def test_a_step_reports_one_stats_record(tiny_store):
    trainer = _trainer(tiny_store, attention="sdpa")
    batches = list(_loader(tiny_store).batches(0))
    result = trainer.train_step(batches[:2])
    assert isinstance(result.stats, LossStats) and result.grad_norm is not None and result.lr == 1e-3
    summary = summarise(result.stats)
    assert summary["loss"] > 0 and len(summary["depth_count"]) == 4
    assert sum(summary["depth_count"]) == result.num_supervised
    record = trainer.window_metrics(1.0)
    assert record["loss"] == pytest.approx(summary["loss"]) and record["graphs_compiled"] == 0


def test_the_clip_folded_into_fused_adamw_gives_clip_grad_norm_s_update():
    """A fused AdamW divides by the clip factor as it reads each gradient (``grad_scale``); the
    update equals clip_grad_norm_ + step, whether the norm is over the limit or under it."""
    from peagle.stages.train.optim import clip_and_step

    for max_norm in (0.05, 1e3):
        results = []
        for fused in (False, True):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11))]
            opt = torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.95), eps=1e-8, fused=fused)
            norms = []
            for step in range(3):
                for p in params:
                    p.grad = torch.randn_like(p, generator=torch.Generator().manual_seed(step)) * 3
                norms.append(clip_and_step(opt, params, max_norm))
            assert not hasattr(opt, "grad_scale")
            results.append(([p.detach().clone() for p in params], norms))
        (plain, plain_norms), (folded, folded_norms) = results
        for a, b in zip(folded, plain):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(torch.stack(folded_norms), torch.stack(plain_norms))
    assert clip_and_step(opt, params, 0.0) is None


def test_a_frozen_head_is_cast_once_and_recast_when_it_changes(tiny_store):
    trainer = _trainer(tiny_store, attention="sdpa")
    draft_step = trainer.step_fn.model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = draft_step.head_compute_weight()
        assert first.dtype == torch.bfloat16 and draft_step.head_compute_weight() is first
        with torch.no_grad():
            trainer.draft.lm_head.weight.mul_(2)  # a load_state_dict, say
        second = draft_step.head_compute_weight()
    assert second is not first
    torch.testing.assert_close(second.float(), (trainer.draft.lm_head.weight.detach()).to(torch.bfloat16).float())
    assert draft_step.head_compute_weight().dtype == torch.float32  # no autocast: the weight itself
