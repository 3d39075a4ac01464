"""Where a CPU training step of a deeper P-EAGLE draft spends its time, and tokens/s before and after
what the profile called for (issue 57: a 4-layer draft is ~4x a 1-layer's per token).

    python benchmarks/train_step_profile.py --store STORE --target DIR \\
        --out benchmarks/results/cpu/train_step_profile.json

Each variant is a real `peagle train` in its own process (recipe_curves.py's ``BASE`` with the
variant's flags: the layers, K_train = 8, 4,096 tokens a step, frozen embeddings), one after the other
on the same cores; its figure is the median ``tokens_per_s`` of metrics.jsonl's windows after the first.

``--profile`` runs each variant once more under ``torch.profiler`` (CPU), its steps after the first two,
with a label around each part the issue names, put there by this script (the product carries none):

* ``attention``: ``decoder_layers.attend`` forward, plus autograd's backward nodes of SDPA;
* ``lm head + loss``: ``chunked_loss_sum`` (the head's matmuls and their gradients run in its forward);
* ``muon newton-schulz``: ``muon.newton_schulz``; ``optimizer, the rest``: ``clip_and_step`` less that;
* ``forward, the rest`` / ``backward, the rest``: the draft's forward / backward less the above;
* ``data wait``: the trainer's own ``data_wait_share`` (the loader's workers run in other processes).

Shares are of the profiled steps' wall time (``TrainStep.__call__``); the profiler's own cost is in
them alike. Compare shares and tokens/s taken in one run: two cores swing with what else runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from train_cpu_step import train_args  # noqa: E402  (the same throughput-only `peagle train` command)

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

DEEP = ["--num-depths", "8", "--token-budget", "4096"]
"""What every variant shares: the paper's K_train and the convergence runs' step size."""
VARIANTS = {
    "1-layer": ["--num-layers", "1", *DEEP],
    "2-layer": ["--num-layers", "2", *DEEP],
    "4-layer": ["--num-layers", "4", *DEEP],
    "4-layer-ns-bf16": ["--num-layers", "4", *DEEP, "--muon-ns-dtype", "bfloat16"],
    "4-layer-compiled": ["--num-layers", "4", *DEEP, "--compile", "layers"],
    "4-layer-8192": ["--num-layers", "4", "--num-depths", "8", "--token-budget", "8192"],
    "4-layer-8192-ns-bf16": ["--num-layers", "4", "--num-depths", "8", "--token-budget", "8192",
                             "--muon-ns-dtype", "bfloat16"],
}
LABELS = ("attention", "lm head + loss", "muon newton-schulz", "optimizer", "forward", "backward", "step")


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind", "train") == "train" and "tokens_per_s" in r]


def median_after_first(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows]
    return statistics.median(values[1:] or values)


def profiled_train(argv: list[str], out: Path) -> None:
    """`peagle train ARGV` in this process with a profiler label around each part (module docstring);
    writes the labels' summed milliseconds over the steps after the first two to ``out``."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from peagle.cli import main as peagle_main
    from peagle.model import decoder_layers
    from peagle.stages.train import muon, optim, step

    def labelled(name: str, fn):
        def wrapper(*args, **kwargs):
            with record_function(f"peagle::{name}"):
                return fn(*args, **kwargs)
        return wrapper

    decoder_layers.attend = labelled("attention", decoder_layers.attend)
    step.chunked_loss_sum = labelled("lm head + loss", step.chunked_loss_sum)
    muon.newton_schulz = labelled("muon newton-schulz", muon.newton_schulz)
    step.clip_and_step = labelled("optimizer", optim.clip_and_step)
    step.DraftStep.forward = labelled("forward", step.DraftStep.forward)
    step.TrainStep._backward = labelled("backward", step.TrainStep._backward)
    profiler = profile(activities=[ProfilerActivity.CPU])
    calls = {"n": 0}
    train_step = step.TrainStep.__call__

    def counted_step(self, micro_batches):
        calls["n"] += 1
        if calls["n"] == 3:  # the first two steps warm caches and allocators
            profiler.start()
        with record_function("peagle::step"):
            return train_step(self, micro_batches)

    step.TrainStep.__call__ = counted_step
    try:
        peagle_main(argv)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    profiler.stop()
    totals: collections.Counter = collections.Counter()
    for event in profiler.key_averages():
        name = event.key
        if name.startswith("peagle::"):
            totals[name.removeprefix("peagle::")] += event.cpu_time_total / 1e3
        elif "evaluate_function" in name and "ScaledDotProduct" in name:
            totals["attention backward"] += event.cpu_time_total / 1e3
    out.write_text(json.dumps({"ms": dict(totals), "profiled_steps": calls["n"] - 2, "torch": torch.__version__}))


def shares(ms: dict[str, float], data_wait_share: float) -> dict[str, float]:
    """The labels' milliseconds as shares of the steps' wall (nested labels subtracted from their parents)."""
    wall = ms["step"]
    attention = ms.get("attention", 0.0) + ms.get("attention backward", 0.0)
    parts = {
        "attention": attention,
        "lm head + loss": ms.get("lm head + loss", 0.0),
        "muon newton-schulz": ms.get("muon newton-schulz", 0.0),
        "optimizer, the rest": ms.get("optimizer", 0.0) - ms.get("muon newton-schulz", 0.0),
        "forward, the rest": ms.get("forward", 0.0) - ms.get("attention", 0.0) - ms.get("lm head + loss", 0.0),
        "backward, the rest": ms.get("backward", 0.0) - ms.get("attention backward", 0.0),
    }
    parts["step, the rest"] = wall - sum(parts.values())
    result = {name: round(value / wall, 3) for name, value in parts.items()}
    result["data wait (of the trainer's wall)"] = round(data_wait_share, 3)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True, help="a store with the draft vocab built (peagle vocab)")
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--profile", action="store_true", help="each variant once more under torch.profiler")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/train_step_profile.json"))
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # the profiled run's own process: ``--child OUT peagle-args...``
        profiled_train(args.child[1:], Path(args.child[0]))
        return
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    result = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_before": os.getloadavg()},
              "date": time.strftime("%Y-%m-%d %H:%M"), "store": "STORE", "steps": args.steps, "variants": {}}
    peagle = [sys.executable, "-m", "peagle"]
    with tempfile.TemporaryDirectory(prefix="train-step-profile-") as tmp:
        for name in args.variants.split(","):
            run = Path(tmp) / name
            command = train_args(args.store, args.target, run, args.steps, VARIANTS[name])
            started = time.time()
            subprocess.run([*peagle, *command], check=True, stdout=subprocess.DEVNULL)
            rows = metrics(run)
            record = {"command": "peagle " + " ".join(command).replace(tmp, "TMP").replace(str(args.store), "STORE")
                      .replace(str(args.target), "TARGET"),
                      "tokens_per_s": round(median_after_first(rows, "tokens_per_s"), 1),
                      "step_time_s": round(median_after_first(rows, "step_time_s"), 3),
                      "wall_s": round(time.time() - started, 1)}
            if args.profile:
                profiled = Path(tmp) / f"{name}-profiled"
                ms_file = Path(tmp) / f"{name}-ms.json"
                command = train_args(args.store, args.target, profiled, args.steps, VARIANTS[name])
                subprocess.run([sys.executable, __file__, "--store", str(args.store), "--target", str(args.target),
                                "--child", str(ms_file), *command], check=True, stdout=subprocess.DEVNULL)
                ms = json.loads(ms_file.read_text())
                record["profile"] = {"shares": shares(ms["ms"], median_after_first(metrics(profiled), "data_wait_share")),
                                     "ms": {k: round(v, 1) for k, v in ms["ms"].items()},
                                     "profiled_steps": ms["profiled_steps"]}
            result["variants"][name] = record
            print(f"{name}: {record['tokens_per_s']:.0f} tokens/s"
                  + (f", shares {record['profile']['shares']}" if args.profile else ""), flush=True)
    result["machine"]["load_after"] = os.getloadavg()
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
