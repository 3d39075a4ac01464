"""One optimizer step, all of it: the compute the trainer (loop.py) runs once per step.

:class:`TrainStep` owns what a step touches: the draft (its matmuls in fp8 with ``--fp8-matmuls``),
its DDP/FSDP2 wrapper, what runs compiled (decided here, once per run: on CUDA each decoder layer
whole with flex attention inside, and the loss's per-chunk pass; model/regional_compile.py), the
optimizer and the LR schedule (optim.py). One call:

1. sums the micro-batches' supervised counts and all-reduces them: ONE global count for the step
   (docs/draft-and-export.md), known before any backward, so every unit charges ``loss_sum · world / count``
   (DDP/FSDP average gradients over ranks; the factor ``world`` undoes that) and nothing is
   averaged per micro-batch. The counts are host ints reduced over a gloo group: no GPU sync;
2. runs one forward+backward per *unit* (a micro-batch, or one of its segments, docs/mask.md; planned
   by the loader workers, ``segments.plan_units``); gradients sync in the last unit's backward only
   (DDP ``no_sync`` / the FSDP2 flag); each unit also returns its rows' top-1 agreement, which
   :func:`batch_chain_stats` turns into the batch's exact chain acceptance sums (loss.py);
3. clips and steps the optimizer (AdamW, or Muon+AdamW with ``--optimizer muon``; fp32 master
   weights; bf16 autocast on CUDA, FSDP2 gathering bf16 parameters and reducing fp32 gradients; a
   fused AdamW applies the clip as it reads the gradients, ``optim.clip_and_step``) and the LR
   schedule (warmup, cosine) -- unless the step is not finite (below).

**A non-finite step is not applied.** Between the backward and the optimizer the step reads ONE
value on the host: whether this rank's loss and the global gradient norm are finite, agreed over
ranks (a gloo sum of the flags, so every replica decides alike). A NaN or inf there (one NaN aux value
in a store suffices) would otherwise reach every weight through the optimizer state and never leave.
Such a step skips ``optimizer.step()`` and zeroes the gradients, so weights and optimizer state
(moments, step counts) stay exactly as they were; the schedule still advances: the step counts as a
step of the run (its batches were consumed, the trainer's step counter moves, ``--max-steps``
includes it), and keeping the LR a function of the step number keeps the cosine ending at the last
step and a resumed run on the uninterrupted run's rates. The trainer counts it and stops the run
past ``--max-bad-steps`` (``bad_steps.py``). The read is the step's one host sync: on a GPU the
optimizer's kernels are queued once the backward has finished instead of behind it.

**No host sync in the forward and backward.** Batches arrive pinned with every index a unit needs (document ids,
unit plans, BlockMask indices) and are copied ``non_blocking`` (on CUDA on a side stream, beside the
previous step: ``device.DevicePrefetcher``); masks are built from them with
device ops; the loss is a chunked KL (or TV, ``--loss``) inside the wrapped forward; the stats
stay on the device (:class:`LossStats`, read by the trainer once per logged step). tests/stages/train/test_step.py
holds the forward+backward to that on the CPU (no op that would sync on a GPU), and the CUDA
tests run it under ``torch.cuda.set_sync_debug_mode("error")``.

Shape letters as in batch.py: T positions, N flat elements, M a unit's elements, R its real (depth-0)
rows, E supervised elements, e those a unit charges, K depths, V draft vocab.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from peagle.model.draft import PEagleDraft
from peagle.model.flex import FLEX_KERNEL_OPTIONS, is_compile_failure
from peagle.model.regional_compile import DraftCompiler, resolve_compile_mode
from peagle.schemas.errors import UserError, one_line
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.aux_noise import noised
from peagle.stages.train.train_batch import TrainBatch
from peagle.stages.train.device import default_compute_dtype, resolve_device
from peagle.stages.train.loss import (LossStats, agreement_rates, chain_acceptance, chain_acceptance_length,
                                      chunked_loss_sum, compute_weight, fused_chunk_loss, matmul_dtype)
from peagle.stages.train.methods import PEAGLE, TrainingMethod, training_method
from peagle.stages.train.optim import build_optimizer, clip_and_step, gradient_norm, lr_factor
from peagle.stages.train.segments import UnitPlan


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; a process group only when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(None, int(os.environ.get("LOCAL_RANK", "0")))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return (dist.get_rank() if world > 1 else 0), world, device


def compiled_graph_count() -> int:
    """Graphs Dynamo has compiled in this process so far (torch's own counter; metrics diff it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


class DraftStep(nn.Module):
    """The training method's forward of a unit + the chunked KL at the charged rows, as ONE module forward.

    DDP and FSDP2 hook into ``forward``: the lm_head matmul (and its gradient, when the head trains)
    must happen inside it. Only the e charged rows reach ``lm_head`` (docs/performance.md), a chunk at a time
    (``chunked_loss_sum``): peak memory does not grow with e × V. Returns the per-forward LossStats
    fields and the rows' top-1 agreement ``correct_e`` as a tuple, which the wrappers' output
    hooks traverse.

    ``compiler`` says what runs compiled (flex attention, the loss's per-chunk pass); None: eager.
    A frozen head is read in the compute dtype through one cached copy (:meth:`head_compute_weight`),
    not cast again for every chunk of every forward.
    """

    def __init__(self, draft: PEagleDraft, num_depths: int, compiler: DraftCompiler | None = None,
                 loss: str = "forward_kl", method: TrainingMethod = PEAGLE):
        super().__init__()
        self.draft, self.num_depths, self.compiler, self.loss = draft, num_depths, compiler, loss
        self.method = method
        self._head_copy: tuple[tuple[Any, ...], Tensor] | None = None

    def forward(self, inputs: tuple, supervised_idx_e: Tensor, target_ids_ek: Tensor, target_probs_ek: Tensor,
                depth_e: Tensor) -> tuple[Tensor, ...]:
        """``inputs``: the unit's ``method.unit_inputs``; the rest: the targets of its charged rows."""
        compiler = self.compiler
        hidden_MH = self.method.hidden_states(self.draft, inputs, compiler and compiler.flex)
        stats, correct_e = chunked_loss_sum(hidden_MH[supervised_idx_e], self.draft.lm_head.weight, target_ids_ek,
                                            target_probs_ek, depth_e, self.num_depths, loss=self.loss,
                                            head_compute_VH=self.head_compute_weight(),
                                            chunk_fn=compiler and compiler.loss_chunk)
        return stats.loss_sum, stats.depth_loss_sum, stats.depth_correct, stats.depth_count, correct_e

    def head_compute_weight(self) -> Tensor:
        """lm_head's weight in the compute dtype (``loss.compute_weight``). A frozen head's cast copy is
        kept while the weight is unchanged (its storage and version counter: a load_state_dict
        bumps it); a trained head, or one already in the compute dtype (FSDP2's bf16 gather), is not
        copied here."""
        weight = self.draft.lm_head.weight
        dtype = matmul_dtype(weight)
        if weight.requires_grad or dtype == weight.dtype:
            return compute_weight(weight)
        key = (weight.data_ptr(), weight._version, weight.device, dtype)
        if self._head_copy is None or self._head_copy[0] != key:
            self._head_copy = (key, compute_weight(weight))
        return self._head_copy[1]


def unit_forward(model: nn.Module, batch: TrainBatch, plan: UnitPlan, *, attention: str,
                 compute_dtype: torch.dtype, method: TrainingMethod = PEAGLE,
                 aux_noise: float = 0.0) -> tuple[LossStats, Tensor]:
    """One unit's KL sums (``loss_sum`` has grad) and the top-1 agreement ``correct_e`` of the rows it
    charges, from a batch already on the device: gathers only (the method's ``unit_inputs``). A model
    in training mode reads its aux states with ``aux_noise`` (aux_noise.py); evaluation never does."""

    def charged(t: Tensor) -> Tensor:
        return t if plan.target_idx_e is None else t[plan.target_idx_e]

    b = batch
    inputs = method.unit_inputs(b, plan, attention)
    if aux_noise > 0 and model.training:
        inputs = (inputs[0], noised(inputs[1], aux_noise), *inputs[2:])  # every method: (tokens, aux, ...)
    device_type = b.tokens_T.device.type
    with torch.autocast(device_type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
        out = model(inputs, plan.supervised_idx_e, charged(b.target_ids_Ek), charged(b.target_probs_Ek),
                    charged(b.depth_E))
    loss_sum, depth_loss_sum, depth_correct, depth_count, correct_e = out
    zero = torch.zeros_like(loss_sum.detach())
    return LossStats(loss_sum, depth_loss_sum, depth_correct, depth_count, zero, zero), correct_e


def batch_chain_stats(batch: TrainBatch, correct_per_unit: list[Tensor]) -> LossStats:
    """The chain sums of a batch (``loss.chain_acceptance``): its units' ``correct_e`` put back in the
    batch's target order first, because one chain's elements may be charged by different units (a
    segment owns a depth-0 element by its anchor, the deeper ones by anchor + 1, docs/mask.md)."""
    correct_E = torch.zeros(batch.num_supervised, dtype=torch.bool, device=batch.chain_target_idx_CK.device)
    for plan, correct_e in zip(batch.units, correct_per_unit, strict=True):
        correct_E = correct_e if plan.target_idx_e is None else correct_E.index_copy(0, plan.target_idx_e, correct_e)
    return chain_acceptance(correct_E, batch.chain_target_idx_CK)


@dataclass(frozen=True)
class StepResult:
    """What one step reports: this rank's summed stats (on the device) and the global counts."""

    stats: LossStats
    num_supervised: float  # global, all ranks
    num_tokens: float
    num_no_target: float
    grad_norm: Tensor | None  # on the device, before clipping
    lr: float
    applied: bool = True  # False: the loss or gradient norm was not finite, the optimizer did not step


class TrainStep:
    """The compute of a step (module docstring) and everything it touches; the trainer owns the rest."""

    def __init__(self, draft: PEagleDraft, config: TrainConfig, *, device: torch.device, attention: str,
                 total_steps: int, world_size: int = 1, cpu_group: Any = None,
                 compute_dtype: torch.dtype | None = None):
        self.config, self.device, self.attention = config, device, attention
        self.world_size, self.cpu_group = world_size, cpu_group
        self.compute_dtype = compute_dtype or default_compute_dtype(device)
        self.draft = draft.to(device)
        if config.fp8_matmuls:  # before compiling: the compiled layers trace the fp8 matmuls
            from peagle.model.fp8_linear import convert_to_fp8_matmuls

            convert_to_fp8_matmuls(self.draft)
        # The compile decision, once per run (regional_compile.py): on CUDA each decoder layer
        # compiled whole with flex attention inside, and the loss's per-chunk pass; eager elsewhere.
        self.compiler = DraftCompiler(self.draft.layers, mode=resolve_compile_mode(config.compile, device),
                                      attention=attention, kernel_options=FLEX_KERNEL_OPTIONS[config.flex_kernel],
                                      loss_chunk=fused_chunk_loss)
        self.method = training_method(config.method)
        self.model = self._parallelize(DraftStep(self.draft, config.cod.num_depths, self.compiler, config.loss,
                                                 self.method))
        self.optimizer = build_optimizer(self.draft, config.optim, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config.optim.warmup_steps, total_steps))

    def describe(self) -> str:
        fp8 = ", fp8 matmuls" if self.config.fp8_matmuls else ""
        return (f"attention {self.attention} ({self.compiler.describe()}), "
                f"compute {str(self.compute_dtype).removeprefix('torch.')}{fp8}")

    def _parallelize(self, module: DraftStep) -> nn.Module:
        if self.world_size == 1:
            return module
        if self.config.fsdp:  # FSDP2: one unit per decoder layer, the rest (embeddings, heads) in the root
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # Gather parameters in the compute dtype (half the all-gather bytes under bf16), reduce
            # gradients in fp32 into the fp32 master shards (as the reference trainers do).
            policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            for layer in module.draft.layers:
                fully_shard(layer, mp_policy=policy)
            return fully_shard(module, mp_policy=policy)
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    # ------------------------------------------------------------------------------------------- the step

    def __call__(self, micro_batches: list[TrainBatch]) -> StepResult:
        """One optimizer step over this rank's micro-batches (module docstring, steps 1-3)."""
        self.optimizer.zero_grad(set_to_none=True)
        stats, counts = self.forward_backward(micro_batches)
        params = [p for p in self.draft.parameters() if p.requires_grad]
        grad_norm = gradient_norm(params)
        applied = self.is_finite(stats.loss_sum, grad_norm)
        if applied:
            clip_and_step(self.optimizer, params, self.config.optim.grad_clip, grad_norm)
        else:  # module docstring: nothing of this step reaches the weights or the optimizer state
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[-1]  # --lr's: the last group is AdamW's for both optimizers
        with warnings.catch_warnings():  # a first step not applied: torch warns of an order it cannot see
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
            self.scheduler.step()
        return StepResult(stats, *counts, grad_norm=grad_norm, lr=lr, applied=applied)

    def is_finite(self, loss_sum: Tensor, grad_norm: Tensor) -> bool:
        """Whether every rank's loss and the gradient norm are finite: the step's one host read
        (module docstring), and under torch.distributed one gloo sum, so that all ranks agree."""
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor of partial norms
            grad_norm = grad_norm.full_tensor()
        finite = bool(torch.isfinite(loss_sum.detach()) & torch.isfinite(grad_norm))
        if self.world_size == 1:
            return finite
        (bad_ranks,) = sum_counts_over_ranks([0.0 if finite else 1.0], self.world_size, self.cpu_group)
        return bad_ranks == 0

    def forward_backward(self, micro_batches: list[TrainBatch]) -> tuple[LossStats, tuple[float, float, float]]:
        """Steps 1-2: one global count, then every unit's forward+backward.

        Returns this rank's summed stats (detached, on the device) and the global (supervised,
        tokens, no-target) counts. A step whose compiled backward failed is redone from no gradients
        (``_backward``): callers start a step from zeroed gradients, as ``__call__`` does.
        """
        counts = [float(sum(b.num_supervised for b in micro_batches)), float(sum(b.num_tokens for b in micro_batches)),
                  float(sum(b.num_no_target for b in micro_batches))]
        # BEFORE any backward: every unit's divisor
        num_supervised, num_tokens, num_no_target = sum_counts_over_ranks(counts, self.world_size, self.cpu_group)
        loss_scale = self.world_size / max(num_supervised, 1.0)
        batches = self.to_device(micro_batches)
        try:
            total = self._units_forward_backward(batches, loss_scale)
        except _CompiledBackwardFailed:  # logged by the compiler; this step's gradients are partial
            for p in self.draft.parameters():
                p.grad = None
            total = self._units_forward_backward(batches, loss_scale)
        return total, (num_supervised, num_tokens, num_no_target)

    def _units_forward_backward(self, batches: list[TrainBatch], loss_scale: float) -> LossStats:
        units = [(j, plan) for j, batch in enumerate(batches) for plan in batch.units]
        correct: list[list[Tensor]] = [[] for _ in batches]
        total = LossStats.zeros(self.config.cod.num_depths, self.device)
        for i, (j, plan) in enumerate(units):
            with self._gradient_sync(i == len(units) - 1):
                stats, correct_e = self._unit_forward(batches[j], plan)
                self._backward(stats.loss_sum * loss_scale)
            total = total + stats.detach()
            correct[j].append(correct_e)
        for batch, correct_per_unit in zip(batches, correct):
            total = total + batch_chain_stats(batch, correct_per_unit)
        return total

    def _backward(self, loss: Tensor) -> None:
        """``loss.backward()``. A failure of the compiled layers' backward falls back to flex compiled
        alone and redoes the step (one process); a compile failure otherwise is one line."""
        try:
            loss.backward()
        except Exception as err:  # noqa: BLE001 - only the compiler's failures are handled
            if self.world_size == 1 and self.compiler.fall_back(err, in_backward=True):
                raise _CompiledBackwardFailed from err
            if not is_compile_failure(err):
                raise
            raise UserError(f"torch.compile failed while compiling the backward ({one_line(err)}); "
                            f"train with --attention sdpa") from err

    @torch.no_grad()
    def evaluate(self, batches: Iterable[TrainBatch]) -> tuple[LossStats, int]:
        """Summed stats over ``batches`` (no gradients) and their ``num_no_target``, both summed over
        ranks: the count is read from the host batches, so it costs no device sync."""
        self.model.eval()
        total = LossStats.zeros(self.config.cod.num_depths, self.device)
        no_target = 0
        for host_batch in batches:
            no_target += host_batch.num_no_target
            batch = host_batch.to(self.device, non_blocking=True)
            correct_per_unit = []
            for plan in batch.units:
                stats, correct_e = self._unit_forward(batch, plan)
                total = total + stats.detach()
                correct_per_unit.append(correct_e)
            total = total + batch_chain_stats(batch, correct_per_unit)
        self.model.train()
        (no_target_all,) = sum_counts_over_ranks([float(no_target)], self.world_size, self.cpu_group)
        return (all_reduce_stats(total) if self.world_size > 1 else total), int(no_target_all)

    def _unit_forward(self, batch: TrainBatch, plan: UnitPlan) -> tuple[LossStats, Tensor]:
        """``unit_forward``; a compile failure of the compiled layers falls back (logged) and reruns."""
        while True:
            try:
                with self.compiler.forward_context():
                    return unit_forward(self.model, batch, plan, attention=self.attention,
                                        compute_dtype=self.compute_dtype, method=self.method,
                                        aux_noise=self.config.aux_noise)
            except Exception as err:  # noqa: BLE001 - only compile failures of the layers are handled
                if not self.compiler.fall_back(err):
                    raise

    def to_device(self, batches: list[TrainBatch]) -> list[TrainBatch]:
        """Copy pinned batches (indices, unit plans and BlockMask indices included) without waiting."""
        return [batch.to(self.device, non_blocking=True) for batch in batches]

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Sync gradients only in the step's last backward (DDP ``no_sync`` / the FSDP2 flag)."""
        if self.world_size == 1:
            return contextlib.nullcontext()
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.model.no_sync()


class _CompiledBackwardFailed(Exception):
    """The compiled layers' backward failed and the compiler fell back: the step starts over."""


def all_reduce_stats(stats: LossStats) -> LossStats:
    """Sum a stats record over ranks: one ``all_reduce`` of its vector (asynchronous for the host on a GPU)."""
    vector = stats.to_vector()
    dist.all_reduce(vector)
    return LossStats.from_vector(vector, stats.num_depths)


def sum_counts_over_ranks(counts: list[float], world_size: int, cpu_group: Any) -> list[float]:
    """Host counts summed over ranks: a float64 CPU tensor all-reduced on the gloo ``cpu_group``."""
    if world_size == 1:
        return counts
    reduced = torch.tensor(counts, dtype=torch.float64)
    dist.all_reduce(reduced, group=cpu_group)
    return reduced.tolist()


def summarise(stats: LossStats) -> dict[str, Any]:
    """Loss over the supervised count, per-depth loss / agreement / count, and the acceptance length of
    the complete chains drawn (host read).

    ``acceptance_length_estimate`` is exact over its chains: ``1 + Σ accepted / num_chains``, each
    chain's accepted drafts its leading run of agreements (``loss.chain_acceptance``), the offline
    evaluator's AL(K) on the same chains. It is an estimate only in that COD draws a random subset
    of the chains offline evaluation reads (``batch.chain_targets``). None without chains.
    """
    s = LossStats.from_vector(stats.to_vector().double().cpu(), stats.num_depths)
    agreement = agreement_rates(s.depth_correct, s.depth_count)
    return {
        "loss": float(s.loss_sum) / max(float(s.depth_count.sum()), 1.0),
        "depth_loss": [float(l / c) if c > 0 else None for l, c in zip(s.depth_loss_sum, s.depth_count)],
        "depth_agreement": [None if math.isnan(a) else float(a) for a in agreement],
        "depth_count": [int(c) for c in s.depth_count],
        "acceptance_length_estimate": chain_acceptance_length(float(s.chain_accepted_sum), float(s.chain_count)),
        "num_chains": int(s.chain_count),
    }
