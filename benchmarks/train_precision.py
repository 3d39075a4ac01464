"""bf16 autocast against float32 for training on a CPU: step speed and what the draft learns.

    python benchmarks/train_precision.py --target DIR --store STORE --eval-store HELD --work WORK \\
        --prompts HELD_PROMPTS --steps 100 --seeds 0 --out benchmarks/results/cpu/train_precision.json

A CPU with AMX runs bf16 matmuls about three times as fast as fp32, so ``peagle train
--compute-dtype bfloat16`` could make CPU experiments cheaper; ``auto`` stays float32 on CPU until a
measurement says bf16 reaches the same acceptance. Each seed trains the same draft twice, one run
per dtype, alternating, with the demo's recipe (1 layer, K = 5, 2,048 tokens a step, lr 3e-3, 20
warm-up steps, ``--max-anchors 16``) and ``--eval-store`` held-out estimates every ``steps // 5``
steps. Per run the JSON keeps: the wall time, the median training tokens/s after the first tenth of
the steps, the last training loss, the last held-out estimate (loss and acceptance length) and, with
``--prompts``, the acceptance length our own loop measures on those held-out prompts
(``peagle eval --mode online``; greedy, so the figure vLLM would give, see docs/quality.md).
The draft vocabulary (``--draft-vocab-size``) must already be built in the store (``peagle vocab``).
The machine's load average is recorded at the end: on a shared machine the speeds are lower bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle.stages.eval.report import read_metrics  # noqa: E402

DTYPES = ("float32", "bfloat16")


def train_command(args: argparse.Namespace, dtype: str, seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "peagle", "train", *[a for s in args.store for a in ("--store", s)],
            "--target", args.target, "--out", str(out), "--compute-dtype", dtype, "--seed", str(seed),
            "--num-layers", "1", "--num-depths", "5", "--draft-vocab-size", str(args.draft_vocab_size),
            "--max-steps", str(args.steps), "--lr", "3e-3", "--warmup-steps", "20", "--token-budget", "2048",
            "--max-anchors", "16", "--heldout-fraction", "0", "--eval-store", args.eval_store,
            "--eval-every", str(max(1, args.steps // 5)), "--save-every", str(args.steps), "--num-workers", "1"]


def train_and_eval_rows(run: Path) -> tuple[list[dict], list[dict]]:
    rows = read_metrics(run)
    return [r for r in rows if r.get("kind") == "train"], [r for r in rows if r.get("kind") == "eval"]


def measured_al(args: argparse.Namespace, run: Path) -> float | None:
    """Acceptance length of the run's final draft in our own loop on the held-out prompts."""
    if not args.prompts:
        return None
    report = run.parent / f"{run.name}-eval"
    subprocess.run([sys.executable, "-m", "peagle", "eval", str(run), "--target", args.target, "--prompts",
                    args.prompts, "--mode", "online", "--max-prompts", str(args.max_prompts), "--max-new-tokens",
                    "64", "--num-depths", "5", "--out", str(report), "--quiet"], check=True)
    return json.loads((report / "report.json").read_text())["comparison"]["online"]["acceptance_length"]


def one_run(args: argparse.Namespace, dtype: str, seed: int) -> dict:
    out = Path(args.work) / f"{dtype}-seed{seed}"
    command = train_command(args, dtype, seed, out)
    start = time.monotonic()
    subprocess.run(command, check=True)
    wall = time.monotonic() - start
    train, evals = train_and_eval_rows(out)
    steady = [r["tokens_per_s"] for r in train if r["step"] > args.steps // 10 and "tokens_per_s" in r]
    return {"dtype": dtype, "seed": seed, "command": " ".join(command[1:]), "wall_s": round(wall, 1),
            "tokens_per_s": statistics.median(steady) if steady else None,
            "final_train_loss": train[-1]["loss"] if train else None,
            "final_heldout_loss": evals[-1]["loss"] if evals else None,
            "final_heldout_al_estimate": evals[-1]["acceptance_length_estimate"] if evals else None,
            "heldout_curve": [(r["step"], r["acceptance_length_estimate"]) for r in evals],
            "online_al": measured_al(args, out)}


def summary(runs: list[dict]) -> dict:
    def mean(dtype: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["dtype"] == dtype and r[key] is not None]
        return statistics.mean(values) if values else None

    out = {d: {k: mean(d, k) for k in ("tokens_per_s", "final_heldout_al_estimate", "online_al",
                                         "final_heldout_loss")} for d in DTYPES}
    fast, slow = out["bfloat16"]["tokens_per_s"], out["float32"]["tokens_per_s"]
    out["bf16_speedup"] = fast / slow if fast and slow else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--store", action="append", required=True)
    parser.add_argument("--eval-store", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--prompts", help="held-out prompts (JSONL): measure each final draft in our own loop")
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--draft-vocab-size", type=int, default=2048)
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = [one_run(args, dtype, int(seed)) for seed in args.seeds.split(",") for dtype in DTYPES]
    result = {"benchmark": "train_precision", "steps": args.steps, "stores": args.store,
              "eval_store": args.eval_store, "runs": runs, "summary": summary(runs),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "load_average_1m_at_end": os.getloadavg()[0]}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
