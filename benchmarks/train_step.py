"""Training-step throughput and peak memory of the P-EAGLE trainer, shaped like the reference harness.

    python benchmarks/train_step.py --tiny --device cpu --out train_step_cpu.json     # CPU check
    python benchmarks/train_step.py --out train_step_h100.json                        # one GPU, 8B shapes
    python benchmarks/train_step.py --layers 4 --seqlens 8192 65536 --partitions 1 8 --activation-checkpointing

What is timed is ``Trainer.train_step`` itself (the code `peagle train` runs): host-to-device copy
of a pinned batch, one forward+backward per (micro-batch, segment) unit with the global-count loss,
gradient clipping (1.0) and a fused AdamW step, fp32 master weights under bf16 autocast on CUDA.
The batch is built beforehand by the loader's own code (``make_item`` + ``collate``: COD sampling,
targets at supervised elements, segment plans, block-mask indices), because in training DataLoader
workers build it off the critical path; its CPU cost is reported as ``collate_ms``.

Shapes follow ../shared/anchors/speculators_gpu/bench.py: an 8B-shaped draft (hidden 4096, 32 heads,
8 kv heads, head dim 128, intermediate 14336, target vocab 128256, draft vocab 32000, 3 aux layers,
Llama-3.1 RoPE), K = 8, r = 0.7, r_min = 0.2, one document per row, every position but the first
supervised, random inputs; ``--tiny`` uses the reference's tiny shapes (hidden 64, vocab 1000/300).
Each configuration: ``--warmup`` steps (the first includes compilation: ``first_step_s``), then the
median of ``--iters`` steps, with a device sync before every clock read; ``--profile`` adds the
top kernels (self device time) of one more step under torch.profiler (``top_kernels``). Peak memory is
``torch.cuda.max_memory_allocated`` over all steps (on CPU: the process's peak RSS so far, which only
grows); ``--memory-cap-gib`` caps what the process may allocate (80: an H100's memory on an H200).
Lengths grow until one runs out of memory, then the next configuration starts; ``--longest-first``
instead tries the lengths as given (longest first) and stops at the first that runs.

Time limits: ``--deadline`` (seconds from the start) starts no configuration after it, and a
SIGTERM (the suite's ``timeout``) ends the run with the configuration in flight written as
``status: timeout`` with the steps it timed so far: a part that runs out keeps what it measured.
The compile mode and flex kernel options are the trainer's (``--compile``, ``--flex-kernel``;
default: what ``peagle train`` does); ``--fp8-layers 4`` adds 4-layer runs with ``--fp8-matmuls``.

FLOP/s: ``matmul_tflops`` counts the matmuls this step executes (fc and layer-0 q/k/v on the R real
rows plus one shared mask row, o_proj/MLP/later layers on all N elements, lm_head on the E
supervised elements; x3 for forward + both backward matmuls, x2 for the frozen lm_head); attention
is excluded as in the reference. ``reference_equivalent_tflops`` divides the reference harness's
own count for the same COD length (its ``linear_flops``) by our step time, so the two are
comparable number for number. JSON: one object per configuration, appended to ``--out`` (jsonl)
and printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from peagle.model.draft import PEagleDraft
from peagle.model.flex import is_out_of_memory as is_oom
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.train_config import TrainConfig
from peagle.pipeline.store_reader import training_sample
from peagle.schemas.loader_config import CodSettings
from peagle.stages.train.batch import collate, make_item
from peagle.stages.train.device import resolve_device
from peagle.stages.train.loop import Trainer
from peagle.testing.trainer import trainer_for_draft

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def dims(tiny: bool) -> dict:
    if tiny:
        return dict(hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=1000, draft_vocab=300)
    return dict(hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, vocab=128256, draft_vocab=32000)


def build_draft(d: dict, num_layers: int, activation_checkpointing: bool, device: torch.device) -> PEagleDraft:
    """The draft, initialised on ``device`` (an 8B-shaped one takes tens of seconds to fill on a CPU)."""
    config = DraftConfig(hidden_size=d["hidden"], num_heads=d["heads"], num_kv_heads=d["kv"], head_dim=d["head_dim"],
                         intermediate_size=d["inter"], rms_norm_eps=1e-5, rope_parameters=dict(LLAMA31_ROPE),
                         num_layers=num_layers, target_hidden_size=d["hidden"], num_aux=3,
                         target_vocab_size=d["vocab"], draft_vocab_size=d["draft_vocab"], mask_token_id=d["vocab"] - 1,
                         max_position_embeddings=131072, aux_layer_ids=[2, 16, 29])
    torch.manual_seed(0)
    with torch.device(device):
        draft = PEagleDraft(config, activation_checkpointing=activation_checkpointing)
    draft.set_vocab_map(torch.randperm(d["vocab"] - 1, generator=torch.Generator().manual_seed(0))[:d["draft_vocab"]]
                        .sort().values)
    return draft


def make_batch(d: dict, seq_len: int, num_segments: int, attention: str, draft: PEagleDraft, seed: int = 0):
    """One row of ``seq_len`` training positions, supervised everywhere but position 0 (and the last,
    which has no next token), through the store reader's shift and the loader's make_item + collate."""
    g = torch.Generator().manual_seed(seed)
    n = seq_len + 1
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[:3] = False  # m[p] = loss_mask[p + 2]: m[0] = 0
    top = torch.randn(n, 32, generator=g).log_softmax(-1).sort(dim=-1, descending=True)
    sample = training_sample("bench", torch.randint(0, d["vocab"] - 1, (n,), generator=g), loss_mask,
                             torch.randn(n, 3, d["hidden"], generator=g).to(torch.bfloat16),
                             torch.randint(0, d["vocab"] - 1, (n, 32), generator=g).to(torch.int32), top.values.half())
    item = make_item(sample, cod=CodSettings(num_depths=8, down_sample_ratio=0.7, down_sample_ratio_min=0.2), seed=seed,
                     epoch=0)
    t2d = draft.t2d.cpu()
    target_to_draft = torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)
    start = time.perf_counter()
    batch = collate([item], target_to_draft_V=target_to_draft,
                    num_segments=num_segments, block_size=128 if attention == "flex" else None)
    return batch, (time.perf_counter() - start) * 1e3


def executed_matmul_flops(d: dict, num_layers: int, num_real: int, num_elements: int, num_supervised: int) -> float:
    h, qd, kvd = d["hidden"], d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    fwd = (num_real + 1) * 2 * 3 * h * h  # fc on real rows + the shared mask row
    fwd += (num_real + 1) * 2 * 2 * h * (qd + 2 * kvd)  # layer-0 q/k/v (2H wide), real rows + one mask row
    fwd += num_elements * 2 * qd * h + num_elements * 2 * 3 * h * d["inter"]  # layer-0 o_proj + MLP
    fwd += (num_layers - 1) * num_elements * 2 * (h * (qd + 2 * kvd) + qd * h + 3 * h * d["inter"])
    return 3 * fwd + 2 * num_supervised * 2 * h * d["draft_vocab"]


def reference_linear_flops(d: dict, num_layers: int, cod_len: int, seq_len: int) -> float:
    """The reference harness's ``linear_flops`` (anchors/speculators_gpu/bench.py), same formula."""
    h, a, v = d["hidden"], 3 * d["hidden"], d["draft_vocab"]
    qd, kvd = d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    fwd = cod_len * 2 * a * h
    for i in range(num_layers):
        din = 2 * h if i == 0 else h
        fwd += cod_len * 2 * din * (qd + 2 * kvd) + cod_len * 2 * qd * h + cod_len * 2 * 3 * h * d["inter"]
    return 3 * fwd + 2 * cod_len * 2 * h * v + seq_len * 2 * h * v


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compile_counters() -> dict:
    try:
        from torch._dynamo.utils import counters

        return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
                "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0}
    except Exception:  # noqa: BLE001 - counters are diagnostics only
        return {}


class Terminated(BaseException):
    """SIGTERM (the suite's per-part timeout): stop, writing what was measured."""


def _terminate(signum, frame):
    raise Terminated()


def cap_memory(device: torch.device, cap_gib: float | None) -> float | None:
    """Let this process allocate at most ``cap_gib`` on ``device`` (None/CPU: no cap); returns the cap applied."""
    if not cap_gib or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return round(fraction * total / 2**30, 2)


def run_one(args, d, trainer: Trainer, rec: dict, num_layers: int, seq_len: int, num_segments: int,
            attention: str) -> dict:
    """Fill ``rec`` as the configuration runs (a SIGTERM mid-way leaves it holding the steps timed so far)."""
    device = trainer.device
    rec.update(describe=trainer.step_fn.describe())
    batch, collate_ms = make_batch(d, seq_len, num_segments, attention, trainer.draft)
    if device.type == "cuda":
        batch = batch.pin_memory()
    rec.update(cod_len=batch.num_elements, num_supervised=batch.num_supervised, collate_ms=round(collate_ms, 1),
               cod_per_depth=torch.bincount(batch.depth_N).tolist())
    warm, times = [], []
    rec.update(warmup_ms=warm, step_ms=times)  # filled in place: a SIGTERM keeps what was timed
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(max(args.warmup, 1 if args.iters == 0 else 0)):
        sync(device)
        start = time.perf_counter()
        trainer.train_step([batch])
        sync(device)
        warm.append(round((time.perf_counter() - start) * 1e3, 1))
        rec["first_step_s"] = round(warm[0] / 1e3, 2)
    before = compile_counters()
    for _ in range(args.iters):
        sync(device)
        start = time.perf_counter()
        trainer.train_step([batch])
        sync(device)
        times.append(round((time.perf_counter() - start) * 1e3, 2))
        if not warm:
            rec["first_step_s"] = round(times[0] / 1e3, 2)
    after = compile_counters()
    median = statistics.median(times) / 1e3
    executed = executed_matmul_flops(d, num_layers, batch.num_tokens, batch.num_elements, batch.num_supervised)
    reference = reference_linear_flops(d, num_layers, batch.num_elements, seq_len)
    loss = trainer.window_metrics(1.0)["loss"]
    rec.update(
        status="ok", median_ms=round(median * 1e3, 2),
        tokens_per_s=round(seq_len / median, 1), cod_tokens_per_s=round(batch.num_elements / median, 1),
        matmul_tflop_per_step=round(executed / 1e12, 4), matmul_tflops=round(executed / median / 1e12, 3),
        reference_equivalent_tflops=round(reference / median / 1e12, 3),
        new_graphs_in_timed_steps=after.get("unique_graphs", 0) - before.get("unique_graphs", 0),
        loss=round(loss, 4))
    record_memory(rec, device)
    if args.profile:
        rec["top_kernels"] = top_kernels(trainer, batch, device)
    return rec


def record_memory(rec: dict, device: torch.device) -> None:
    if device.type == "cuda":
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    else:
        rec["peak_rss_gib_process"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def top_kernels(trainer: Trainer, batch, device: torch.device, count: int = 12) -> list[dict]:
    """One more step under torch.profiler: the kernels (CPU ops on CPU) with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        trainer.train_step([batch])
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
    total = sum(getattr(e, key, 0) for e in events) or 1
    return [{"name": e.key[:120], "ms": round(getattr(e, key) / 1e3, 2), "share": round(getattr(e, key) / total, 3),
             "calls": e.count} for e in events[:count]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--tiny", action="store_true", help="the reference harness's tiny shapes (CPU check)")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seqlens", type=int, nargs="+", default=None,
                    help="row lengths L (default: 2048..65536 on GPU, 256 512 1024 with --tiny)")
    ap.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4, 8], help="sequence partitions S")
    ap.add_argument("--attention", nargs="+", default=None, help="flex and/or sdpa (default: both on CUDA, sdpa on CPU)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--compile", default="auto", help="the trainer's --compile (layers, flex, off, auto)")
    ap.add_argument("--flex-kernel", default="auto", help="the trainer's --flex-kernel")
    ap.add_argument("--fp8-layers", type=int, nargs="*", default=[],
                    help="after the rest, the same lengths for these layer counts with --fp8-matmuls")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="record the top kernels of one extra profiled step")
    ap.add_argument("--longest-first", action="store_true",
                    help="try --seqlens in the order given and stop at the first that runs (longest context)")
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="allocate at most this much device memory")
    ap.add_argument("--deadline", type=float, default=None, help="start no configuration after this many seconds")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="jsonl file to append one object per configuration to")
    args = ap.parse_args()
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _terminate)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cap = cap_memory(device, args.memory_cap_gib)
    seqlens = args.seqlens or ([256, 512, 1024] if args.tiny else [2048, 4096, 8192, 16384, 32768, 65536])
    attentions = args.attention or (["flex", "sdpa"] if device.type == "cuda" else ["sdpa"])
    d = dims(args.tiny)
    env = dict(kind="env", python=platform.python_version(), torch=torch.__version__, device=str(device),
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               cpu_threads=torch.get_num_threads(), memory_cap_gib=cap, argv=sys.argv[1:])
    emit(args.out, env)
    runs = [(n, False) for n in args.layers] + [(n, True) for n in args.fp8_layers]
    try:
        for num_layers, fp8 in runs:
            for attention in attentions:
                for num_segments in args.partitions:
                    for seq_len in seqlens:
                        rec = dict(kind="train_step", layers=num_layers, seq_len=seq_len, partitions=num_segments,
                                   attention=attention, activation_checkpointing=args.activation_checkpointing,
                                   compile=args.compile, flex_kernel=args.flex_kernel, fp8_matmuls=fp8,
                                   device=str(device), tiny=args.tiny)
                        if args.deadline is not None and time.monotonic() - started > args.deadline:
                            emit(args.out, {**rec, "status": "skipped", "error": f"deadline: {args.deadline:.0f}s spent"})
                            continue
                        run_config(args, d, device, rec, num_layers, seq_len, num_segments, attention)
                        if rec["status"] != "ok" and not args.longest_first:
                            break
                        if rec["status"] == "ok" and args.longest_first:
                            break
    except Terminated:
        print("train_step.py: SIGTERM: stopped, the configuration in flight written as status timeout",
              file=sys.stderr, flush=True)
        sys.exit(124)


def run_config(args, d, device: torch.device, rec: dict, num_layers: int, seq_len: int, num_segments: int,
               attention: str) -> None:
    """One configuration, written to ``--out`` whatever happens to it (ok, oom, error, or a SIGTERM)."""
    trainer = draft = None
    try:
        config = TrainConfig.from_flags(store=("bench",), target="bench", out="bench", num_depths=8,
                                        sequence_partitions=num_segments, attention=attention, max_steps=10**6,
                                        lr=1e-4, warmup_steps=0, grad_clip=1.0, weight_decay=0.01,
                                        activation_checkpointing=args.activation_checkpointing, compile=args.compile,
                                        flex_kernel=args.flex_kernel, fp8_matmuls=rec["fp8_matmuls"],
                                        optimizer="adamw")  # the reference trainer's: a like-for-like step
        draft = build_draft(d, num_layers, args.activation_checkpointing, device)
        trainer = trainer_for_draft(config, draft.to(device))
        run_one(args, d, trainer, rec, num_layers, seq_len, num_segments, attention)
    except Terminated:
        rec.update(status="timeout", error="SIGTERM: the part's time ran out in this configuration")
        record_memory(rec, device)
        emit(args.out, rec)
        raise
    except Exception as err:  # noqa: BLE001 - record and go on (OOM ends this length sweep)
        rec.update(status="oom" if is_oom(err) else "error", error=f"{type(err).__name__}: {str(err)[:500]}")
        if not is_oom(err):  # the JSON keeps one line; the log gets where it came from
            traceback.print_exc(file=sys.stderr)
        record_memory(rec, device)
    emit(args.out, rec)
    trainer = draft = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def emit(path: str | None, rec: dict) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if path:
        with open(Path(path), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
