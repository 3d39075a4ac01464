"""Where a CPU training step of the 1-layer SmolLM2 draft spends its time, and tokens/s by recipe.

    python benchmarks/train_cpu_step.py --store STORE --target DIR --out benchmarks/results/cpu/train_cpu_step.json

Each variant is a real `peagle train` (recipe_curves.py's ``BASE``: 1 layer, K = 5, vocab 2,048,
``--max-anchors 16``, the CPU's default compute dtype) for ``--steps`` steps on ``--store``, one after
the other on quiet cores; the figure is the median ``tokens_per_s`` of its metrics.jsonl windows
after the first. One more run of the first variant is sampled by py-spy (``--profile``, when
``py-spy`` is on PATH) and its samples are summed by function: the share of the step in the
forward, the backward, the optimizer (Muon's Newton-Schulz apart) and the rest.

Why the variants: a profile of the 2,048-token step on 2 cores put about a third of it in Muon's
Newton-Schulz iterations (five rounds of matmuls on every decoder matrix, whatever the batch), a
cost per optimizer step, not per token; more tokens per step spread it (``--token-budget``), and
AdamW has none.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from recipe_curves import BASE  # noqa: E402

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

VARIANTS = {
    "muon-2048": [],  # BASE: what every CPU figure so far trained with
    "muon-4096": ["--token-budget", "4096"],
    "muon-8192": ["--token-budget", "8192"],
    "adamw-2048": ["--optimizer", "adamw"],
}
PROFILE_GROUPS = (("newton_schulz (", "optimizer: Muon's Newton-Schulz"), ("clip_and_step (", "optimizer: the rest"),
                  ("TrainStep._backward (", "backward"), ("TrainStep._unit_forward (", "forward and loss"))
"""(start of a py-spy frame, what it counts as), first match first."""


def train_args(store: Path, target: Path, out: Path, steps: int, flags: list[str]) -> list[str]:
    base = [w for pair in zip(BASE[::2], BASE[1::2]) if pair[0] not in ("--eval-every", "--save-every") for w in pair]
    merged = dict(zip(base[::2], base[1::2])) | dict(zip(flags[::2], flags[1::2]))
    return ["train", "--store", str(store), "--target", str(target), "--out", str(out), "--max-steps", str(steps),
            "--heldout-fraction", "0", "--eval-every", "0", "--save-every", "0", "--log-every", "5",
            "--no-train-embeddings", *[w for pair in merged.items() for w in pair]]


def tokens_per_s(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    speeds = [r["tokens_per_s"] for r in rows if r.get("kind", "train") == "train" and "tokens_per_s" in r]
    return statistics.median(speeds[1:] or speeds)


def profile_shares(samples: Path) -> dict[str, float]:
    """py-spy raw samples summed into :data:`PROFILE_GROUPS` (a frame counts for the first group it holds)."""
    totals: collections.Counter = collections.Counter()
    step = 0
    for line in samples.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "Trainer.train_step" not in stack:
            continue
        step += int(count)
        frames = stack.split(";")
        group = next((label for key, label in PROFILE_GROUPS if any(f.startswith(key) for f in frames)),
                     "the rest of the step")
        totals[group] += int(count)
    return {label: round(n / step, 3) for label, n in totals.most_common()} if step else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True, help="a store with the draft vocab built (peagle vocab)")
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/train_cpu_step.json"))
    args = parser.parse_args(argv)
    peagle = [sys.executable, "-m", "peagle"]
    result = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_before": os.getloadavg()},
              "date": time.strftime("%Y-%m-%d %H:%M"), "store": str(args.store), "steps": args.steps, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="train-cpu-step-") as tmp:
        for name in args.variants.split(","):
            command = train_args(args.store, args.target, Path(tmp) / name, args.steps, VARIANTS[name])
            started = time.time()
            subprocess.run([*peagle, *command], check=True, stdout=subprocess.DEVNULL)
            result["variants"][name] = {"command": "peagle " + " ".join(command).replace(tmp, "TMP"),
                                        "tokens_per_s": round(tokens_per_s(Path(tmp) / name), 1),
                                        "wall_s": round(time.time() - started, 1)}
            print(f"{name}: {result['variants'][name]['tokens_per_s']:.0f} tokens/s", flush=True)
        spy = shutil.which("py-spy")
        if args.profile and spy:
            first = args.variants.split(",")[0]
            samples = Path(tmp) / "profile.txt"
            command = train_args(args.store, args.target, Path(tmp) / "profiled", args.steps, VARIANTS[first])
            subprocess.run([spy, "record", "-o", str(samples), "-f", "raw", "-r", "50", "--", *peagle, *command],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            result["profile"] = {"variant": first, "shares": profile_shares(samples)}
            print(f"profile of {first}: {result['profile']['shares']}", flush=True)
    result["machine"]["load_after"] = os.getloadavg()
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
