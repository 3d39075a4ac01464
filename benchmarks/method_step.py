"""Cost of one training step per method: P-EAGLE (one forward) vs EAGLE-3 with training-time test (K forwards).

    python benchmarks/method_step.py                                   # the README figure (CPU, ~4 minutes)
    python benchmarks/method_step.py --depths 3 5 8 --token-budget 4096 --out /tmp/m.json
    python benchmarks/method_step.py --shape tiny --steps 1 --out /tmp/m.json  # a check that it runs, no figure

Both methods train the same draft on the same batches' samples at the same token budget through the
real trainer (``peagle.testing.trainer.trainer_for_draft``: the code `peagle train` runs per step,
Muon + the EAGLE-3.1 norms as today's defaults, fp32 on CPU, SDPA per document). What differs is
what the method makes of a sample: P-EAGLE's COD draw at its defaults (every position at depth 0,
a shrinking random subset of the supervised chains deeper: r = 0.7, r_min = 0.2, no --max-anchors;
docs/cod.md) in one draft forward; EAGLE-3's every
chain at every depth, unrolled in K forwards (docs/methods.md). So EAGLE-3's step holds more
elements and runs K passes; this script says how much that costs.

Draft: the quality benchmark's (1 layer, SmolLM2-135M-shaped: hidden 576, 9 heads, 3 KV heads,
MLP 1536, target vocab 49152, draft vocab 2048), random weights; ``--shape tiny`` (hidden 64, target
vocab 1024) only checks that the script runs, in seconds. Samples: chat-shaped, 256 tokens,
the last ``--supervised-share`` of each supervised (an answer after its prompt), random aux states
and top-8 targets. Per method and K: ``--warmup`` steps, then ``--steps`` timed ones, the runs'
steps interleaved (step i of every run in turn, so a shared machine's load falls on all alike);
reported are the median wall seconds and the process CPU seconds (user + system, every thread) per
step, the flat elements per batch, and EAGLE-3's ratios over P-EAGLE. JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from peagle.model.draft import PEagleDraft
from peagle.pipeline.atomic import atomic_write_json
from peagle.pipeline.store_reader import training_sample
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.loader_config import CodSettings
from peagle.schemas.train_config import TrainConfig
from peagle.stages.train.batch import collate, make_item
from peagle.stages.train.methods import training_method
from peagle.testing.trainer import trainer_for_draft

SHAPES = {"smollm2": dict(hidden=576, heads=9, kv=3, head_dim=64, inter=1536, vocab=49152, draft_vocab=2048),
          "tiny": dict(hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=1024, draft_vocab=128)}
NUM_AUX, TOPK = 3, 8


def draft_for(method: str, s: dict, seed: int = 0) -> PEagleDraft:
    config = DraftConfig(hidden_size=s["hidden"], num_heads=s["heads"], num_kv_heads=s["kv"], head_dim=s["head_dim"],
                         intermediate_size=s["inter"], rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, num_layers=1,
                         target_hidden_size=s["hidden"], num_aux=NUM_AUX, target_vocab_size=s["vocab"],
                         draft_vocab_size=s["draft_vocab"], mask_token_id=s["vocab"] - 1 if method == "peagle" else None,
                         method=method, max_position_embeddings=8192, aux_layer_ids=[2, 15, 27],
                         norm_before_residual=True, norm_before_fc=True, fc_norm=True)
    torch.manual_seed(seed)
    draft = PEagleDraft(config)
    draft.set_vocab_map(torch.arange(s["draft_vocab"]) * (s["vocab"] // s["draft_vocab"] - 1))
    return draft


def samples(count: int, length: int, supervised_share: float, seed: int, s: dict) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(count):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[int(length * (1 - supervised_share)):] = True  # the answer after its prompt
        top = torch.randn(length, TOPK, generator=g).log_softmax(-1).sort(dim=-1, descending=True)
        ids = torch.randint(0, s["vocab"] - 1, (length, TOPK), generator=g, dtype=torch.int32)
        out.append(training_sample(f"b{seed}-{j}", torch.randint(0, s["vocab"] - 1, (length,), generator=g), mask,
                                   torch.randn(length, NUM_AUX, s["hidden"], generator=g).to(torch.bfloat16),
                                   ids, top.values.half()))
    return out


class Run:
    """One (method, K): its trainer around a fresh draft and its batches, built before any clock runs."""

    def __init__(self, method: str, num_depths: int, args):
        self.method, self.num_depths = method, num_depths
        shape = SHAPES[args.shape]
        draft = draft_for(method, shape)
        t2d = draft.t2d
        target_to_draft = torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)
        per_batch = args.token_budget // (args.sample_tokens - 1)
        self.batches = []
        for step in range(args.warmup + args.steps):
            items = [make_item(s, cod=CodSettings(num_depths=num_depths), seed=step, epoch=0,
                               method=training_method(method))
                     for s in samples(per_batch, args.sample_tokens, args.supervised_share, step, shape)]
            self.batches.append(collate(items, target_to_draft_V=target_to_draft, method=training_method(method)))
        config = TrainConfig.from_flags(store=("unused",), target="unused", out="unused", method=method,
                                        num_depths=num_depths, token_budget=args.token_budget, attention="sdpa",
                                        max_steps=len(self.batches), warmup_steps=0)
        self.trainer = trainer_for_draft(config, draft)
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self, i: int, timed: bool) -> None:
        start, start_cpu = time.perf_counter(), time.process_time()
        self.trainer.train_step([self.batches[i]])
        if timed:
            self.wall.append(time.perf_counter() - start)
            self.cpu.append(time.process_time() - start_cpu)

    def row(self) -> dict:
        b = self.batches
        return {"method": self.method, "num_depths": self.num_depths, "tokens_per_batch": b[0].num_tokens,
                "elements_per_batch": statistics.fmean(x.num_elements for x in b),
                "supervised_per_batch": statistics.fmean(x.num_supervised for x in b),
                "wall_s_per_step": statistics.median(self.wall), "cpu_s_per_step": statistics.median(self.cpu),
                "wall_s_all": self.wall, "cpu_s_all": self.cpu}


def measure(args) -> list[dict]:
    """Every (method, K) run, their steps interleaved (step i of each in turn): on a shared machine the
    neighbours' load then falls on every run alike, and the ratios compare like with like."""
    runs = [Run(method, k, args) for k in args.depths for method in ("peagle", "eagle3")]
    for i in range(args.warmup + args.steps):
        for run in runs:
            run.step(i, timed=i >= args.warmup)
    return [run.row() for run in runs]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[3, 5], help="K values (default: 3 5)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2",
                    help="draft shape (default smollm2: the figure's; tiny: a check that the script runs)")
    ap.add_argument("--token-budget", type=int, default=2048, help="training positions per batch (default 2048)")
    ap.add_argument("--sample-tokens", type=int, default=257, help="tokens per sample (default 257: 256 positions)")
    ap.add_argument("--supervised-share", type=float, default=0.5, help="supervised share of each sample (default 0.5)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/method_step.json"))
    args = ap.parse_args(argv)
    rows = measure(args)
    by = {(r["method"], r["num_depths"]): r for r in rows}
    ratios = {str(k): {key: by[("eagle3", k)][key] / by[("peagle", k)][key]
                       for key in ("elements_per_batch", "wall_s_per_step", "cpu_s_per_step")} for k in args.depths}
    result = {"rows": rows, "eagle3_over_peagle": ratios,
              "settings": {**vars(args), "out": str(args.out), "draft_shape": SHAPES[args.shape], "num_layers": 1},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "load_average": os.getloadavg()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"{'method':<8} {'K':>2} {'elements':>9} {'supervised':>10} {'wall s/step':>12} {'CPU s/step':>11}")
    for r in rows:
        print(f"{r['method']:<8} {r['num_depths']:>2} {r['elements_per_batch']:>9.0f} {r['supervised_per_batch']:>10.0f} "
              f"{r['wall_s_per_step']:>12.3f} {r['cpu_s_per_step']:>11.3f}")
    for k, ratio in ratios.items():
        print(f"K = {k}: EAGLE-3 / P-EAGLE: {ratio['elements_per_batch']:.2f}x elements, "
              f"{ratio['cpu_s_per_step']:.2f}x CPU per step, {ratio['wall_s_per_step']:.2f}x wall")
    print(f"results: {args.out}")
    return result


if __name__ == "__main__":
    main()
