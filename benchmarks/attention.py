"""Flex attention alone on the P-EAGLE mask: the kernel options, a padded static N and the FA4 backend, A/B.

    python benchmarks/attention.py --out attention.jsonl                      # one GPU, L = 8192, 8B heads
    python benchmarks/attention.py --tiny --device cpu --eager --out a.jsonl  # CPU check (forward only)

The row is the one benchmarks/train_step.py trains on (L = 8192, K = 8, r = 0.7, r_min = 0.2, built by
the loader's own ``make_item`` + ``collate``), its BlockMask built from the indices the loader
workers compute, exactly as the trainer builds it; q/k/v are random bf16 ``[1, 32 | 8, N, 128]``
(GQA), the shapes of the 8B-shaped draft. Each variant is ``torch.compile(flex_attention)`` with:

* ``auto``: torch's own kernel options, ``dynamic=True`` (what the trainer ran before
  ``--flex-kernel``, and what the reference trainer runs);
* the trainer's named options (``--flex-kernel``: ``rows-safe``, ``tma``, ``flash``);
* block-size / warp / stage choices for the forward and backward kernels (``BLOCK_VARIANTS``);
* ``pad128-static``: N padded to a multiple of 128 (padding elements see nothing and nobody sees
  them) and compiled for that one static size, so every block is whole.

Per variant: the first call (compile included), the median of ``--iters`` forward+backward and
forward-only calls (device sync around each), the useful TFLOP/s (4·pairs·D·heads per forward,
x3.5 for forward+backward, as the reference counts), and the output's largest relative difference
from ``auto``'s (a variant must compute the same attention). ``flash`` needs ``flash_attn.cute``
(flash-attn-4 and nvidia-cutlass-dsl, whose 92 MB library wheel travels to a GPU machine in two
parts: ``gpu_suite.sh --fa4``), so where it is missing its record says so. ``--deadline`` starts no variant after that many seconds and a
SIGTERM writes the variant in flight as ``timeout``; JSON: one object per variant, appended to
``--out``. The reference's own attention-only mode (``bench.py --mode attn``) runs beside this in
the GPU suite's ``attention`` part.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import statistics
import sys
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from peagle.model.flex import FLEX_KERNEL_OPTIONS
from peagle.model.mask import dense_mask, peagle_mask_mod
from peagle.schemas.errors import one_line
from peagle.stages.train.device import resolve_device
from train_step import build_draft, dims, make_batch

BLOCK_VARIANTS: dict[str, dict] = {
    "fwd128x128-w8-s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "bwd64x64-w4-s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                       "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd32x128-w4-s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd64x128-w8-s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 8, "bwd_num_stages": 2},
}
"""Candidates next to torch's sm90 defaults for bf16, head dim 128 (forward 128x64, 8 warps, 3 stages;
backward 64/128/128/64, 8 warps, 3 stages): each kernel block must divide the mask's 128 blocks,
and the backward needs BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0."""

DEFAULT_VARIANTS = ("auto", "rows-safe", "tma", *BLOCK_VARIANTS, "pad128-static", "flash")


class Terminated(BaseException):
    pass


def _terminate(signum, frame):
    raise Terminated()


def emit(path: str | None, rec: dict) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def variant_options(name: str) -> tuple[dict, bool]:
    """(kernel_options, pad to 128 and compile static) of a variant name."""
    if name == "pad128-static":
        return {}, True
    if name in FLEX_KERNEL_OPTIONS:
        return dict(FLEX_KERNEL_OPTIONS[name]), False
    return dict(BLOCK_VARIANTS[name]), False


def flash_missing() -> str | None:
    """Why the FLASH backend cannot run here (None: it can try)."""
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return ("flash_attn.cute is not installed (flash-attn-4 and nvidia-cutlass-dsl: on a GPU machine, "
                "gpu_suite.sh --fa4 installs them from the parts scripts/download_gpu_wheels.sh makes)")
    return None


def padded_mask(block_mask: BlockMask, anchor_N, depth_N, doc_N, multiple: int):
    """The same BlockMask over N padded to a multiple of ``multiple``: padding elements (document -1)
    see nothing and are seen by nobody, and the block indices stay as they are (N's last block
    already counts as one)."""
    n = anchor_N.numel()
    padded = -(-n // multiple) * multiple
    extra = padded - n

    def pad(t, value):
        return torch.cat([t, t.new_full((extra,), value)])

    anchor, depth, doc = pad(anchor_N, 0), pad(depth_N, 0), pad(doc_N, -1)
    mask = BlockMask.from_kv_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                    block_mask.full_kv_indices, BLOCK_SIZE=block_mask.BLOCK_SIZE,
                                    mask_mod=peagle_mask_mod(anchor, depth, doc), seq_lengths=(padded, padded))
    return mask, padded


def time_calls(fn, device: torch.device, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(round((time.perf_counter() - start) * 1e3, 3))
    return times


def run_variant(args, name: str, inputs: dict, reference: dict, rec: dict) -> None:
    device, block_mask = inputs["device"], inputs["block_mask"]
    if name == "flash" and flash_missing():
        rec.update(status="unavailable", error=flash_missing())
        return
    options, pad = variant_options(name)
    q, k, v, go = inputs["q"], inputs["k"], inputs["v"], inputs["grad_out"]
    n = q.shape[2]
    if pad:
        block_mask, padded = padded_mask(block_mask, inputs["anchor"], inputs["depth"], inputs["doc"], 128)

        def widen(t):
            return torch.cat([t.detach(), t.new_zeros(*t.shape[:2], padded - n, t.shape[3])], dim=2)

        grad = not args.forward_only
        q, k, v, go = (widen(q).requires_grad_(grad), widen(k).requires_grad_(grad), widen(v).requires_grad_(grad),
                       widen(go))
        rec["padded_len"] = padded
    fn = flex_attention if args.eager else torch.compile(flex_attention, dynamic=not pad)
    kwargs = dict(block_mask=block_mask, enable_gqa=True, kernel_options=options or None)
    rec.update(kernel_options=options, static_padded=pad)

    def forward():
        with torch.no_grad():
            return fn(q, k, v, **kwargs)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        fn(q, k, v, **kwargs).backward(go)

    start = time.perf_counter()
    out = forward()[:, :, :n]
    if not args.forward_only:
        forward_backward()
    sync(device)
    rec["first_call_s"] = round(time.perf_counter() - start, 2)
    if "out" not in reference:
        reference["out"] = out.float()
    rec["max_rel_diff_vs_auto"] = round(float((out.float() - reference["out"]).abs().max()
                                              / reference["out"].abs().max()), 5)
    rec["fwd_ms_all"] = time_calls(forward, device, args.iters)
    rec["fwd_ms"] = round(statistics.median(rec["fwd_ms_all"]), 3)
    if not args.forward_only:
        rec["fwd_bwd_ms_all"] = time_calls(forward_backward, device, args.iters)
        rec["fwd_bwd_ms"] = round(statistics.median(rec["fwd_bwd_ms_all"]), 3)
        rec["bwd_over_fwd"] = round(rec["fwd_bwd_ms"] / rec["fwd_ms"] - 1, 2)
        rec["useful_tflops"] = round(inputs["flops_fwd"] * 3.5 / (rec["fwd_bwd_ms"] / 1e3) / 1e12, 1)
    rec["status"] = "ok"


def build_inputs(args, device: torch.device) -> dict:
    d = dims(args.tiny)
    draft = build_draft(d, 1, False, torch.device("cpu"))  # only its vocab map is read
    batch, _ = make_batch(d, args.seq_len, 1, "flex", draft)
    batch = batch.to(device)
    (unit,) = batch.units
    from peagle.model.mask import block_mask_from_indices

    anchor, depth, doc = batch.anchor_N, batch.depth_N, batch.doc_N
    block_mask = block_mask_from_indices(unit.block_indices, peagle_mask_mod(anchor, depth, doc), device=device)
    n = anchor.numel()
    pairs = int(dense_mask(anchor, depth, doc).sum())  # [N, N] bool: 0.8 GB at L = 8192, once
    g = torch.Generator(device=device).manual_seed(0)

    def rand(heads):
        return torch.randn(1, heads, n, d["head_dim"], device=device, dtype=torch.bfloat16, generator=g)

    grad = not args.forward_only  # flex refuses CPU inputs that require grad, even under no_grad
    q, k, v = (rand(h).requires_grad_(grad) for h in (d["heads"], d["kv"], d["kv"]))
    return dict(device=device, block_mask=block_mask, anchor=anchor, depth=depth, doc=doc, q=q, k=k, v=v,
                grad_out=rand(d["heads"]), cod_len=n, pairs=pairs,
                flops_fwd=4.0 * pairs * d["head_dim"] * d["heads"], sparsity=float(block_mask.sparsity()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                    help=f"any of {', '.join(DEFAULT_VARIANTS)}")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="eager flex_attention (CPU check: no compile)")
    ap.add_argument("--forward-only", action="store_true", help="no backward (flex has none on the CPU)")
    ap.add_argument("--deadline", type=float, default=None, help="start no variant after this many seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for name in args.variants:
        if name not in DEFAULT_VARIANTS:
            ap.error(f"unknown variant {name} (known: {', '.join(DEFAULT_VARIANTS)})")
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _terminate)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    inputs = build_inputs(args, device)
    base = dict(kind="attention", seq_len=args.seq_len, cod_len=inputs["cod_len"], allowed_pairs=inputs["pairs"],
                mask_density=round(inputs["pairs"] / inputs["cod_len"] ** 2, 5),
                block_sparsity_pct=round(inputs["sparsity"], 2), device=str(device), torch=torch.__version__,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, eager=args.eager)
    reference: dict = {}
    try:
        for name in args.variants:
            rec = dict(base, variant=name)
            if args.deadline is not None and time.monotonic() - started > args.deadline:
                emit(args.out, {**rec, "status": "skipped", "error": f"deadline: {args.deadline:.0f}s spent"})
                continue
            try:
                run_variant(args, name, inputs, reference, rec)
            except Terminated:
                emit(args.out, {**rec, "status": "timeout", "error": "SIGTERM: the part's time ran out"})
                raise
            except Exception as err:  # noqa: BLE001 - a variant that fails is a finding, not the end
                rec.update(status="error", error=one_line(err, 400))
            emit(args.out, rec)
            torch._dynamo.reset()  # each variant compiles on its own
    except Terminated:
        sys.exit(124)


if __name__ == "__main__":
    main()
