"""Recipe curves: how held-out acceptance grows with training steps, per recipe, on the real model.

    python benchmarks/recipe_curves.py --target DIR --heldout-store HELD \\
        --store small=STORE_128_CHATS --store large=STORE_512_CHATS --work WORK

``benchmarks/quality.py`` ranks variants by the acceptance of the *finished* draft, over seeds, in
vLLM. This benchmark answers the question that comes before it on a real target, where a CPU can
make little data: does a recipe still gain from more steps, or has the draft started to memorise
its data? Each recipe trains one draft (seed 0) with ``peagle train --eval-store HELD --eval-every
25``: every 25 steps the trainer measures, teacher-forced on the held-out store (the target's greedy
answers to prompts about subjects no training prompt is about), per-depth agreement and its
acceptance-length estimate. With greedy data, a chain accepted on the stored text is the chain
greedy verification accepts, so the estimate follows the AL vLLM measures; it is not the same figure
(it reads deep depths on COD-sampled chains): ``--serve`` exports a recipe's final draft and measures
it in vLLM on held-out prompts, and the JSON keeps both.

A recipe is a store name plus extra ``peagle train`` flags (:data:`RECIPES`); the budget is
:data:`BASE` (1-layer draft, K = 5, vocab 2,048, 2,048 tokens per step, 300 steps, at most 16
chains per sample). A finished run in ``--work`` (its last eval line at the last step) is reused,
so a cut-short benchmark resumes. JSON out (``--out``): per recipe its command and the curve.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from peagle.pipeline.atomic import atomic_write_json

STEPS = 300
EVAL_EVERY = 25
VOCAB = 2048
BASE = ["--num-layers", "1", "--num-depths", "5", "--draft-vocab-size", str(VOCAB), "--token-budget", "2048",
        "--lr", "3e-3", "--warmup-steps", "30", "--max-steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
        "--save-every", "0", "--seed", "0", "--num-workers", "1", "--max-anchors", "16"]
"""Today's defaults otherwise (Muon, the EAGLE-3.1 norms, forward KL)."""

RECIPES: dict[str, tuple[str, list[str]]] = {
    "base": ("small", []),
    "frozen-embeddings": ("small", ["--no-train-embeddings"]),
    "4x-data": ("large", []),
}
"""name -> (store name, extra flags)."""


def run_recipe(name: str, store: Path, extra: list[str], *, target: Path, heldout: Path, work: Path) -> dict:
    run = work / name
    args = [sys.executable, "-m", "peagle", "train", "--store", str(store), "--target", str(target), "--out", str(run),
            *BASE, "--eval-store", str(heldout), *extra]
    curve = read_curve(run)
    if not curve or curve[-1]["step"] != STEPS:
        vocab = [sys.executable, "-m", "peagle", "vocab", "--store", str(store), "--draft-vocab-size", str(VOCAB),
                 "--quiet"]
        if not (store / "vocab" / f"draft-{VOCAB}.json").exists():
            subprocess.run(vocab, check=True)
        subprocess.run(["rm", "-rf", str(run)], check=True)
        print(f"$ {shlex.join(args[2:])}", flush=True)
        subprocess.run(args, check=True)
        curve = read_curve(run)
    return {"recipe": name, "store": str(store), "command": shlex.join(["peagle", *args[3:]]), "curve": curve,
            "best": max(curve, key=lambda c: c["al_estimate"]) if curve else None}


def serve_in_vllm(run: Path, *, target: Path, prompts: Path) -> dict:
    """Export the finished draft and measure it in vLLM at K = 5 on the held-out prompts (32 prompts,
    128 new tokens; reused when its report exists): the check of what the curve estimates."""
    report = run / "report" / "report.json"
    if not report.exists():
        peagle = [sys.executable, "-m", "peagle"]
        subprocess.run([*peagle, "export", str(run), "--out", str(run / "export"), "--speculative-tokens", "5"],
                       check=True)
        subprocess.run([*peagle, "eval", str(run / "export"), "--target", str(target), "--prompts", str(prompts),
                        "--out", str(run / "report"), "--num-depths", "5", "--mode", "vllm", "--max-prompts", "32",
                        "--max-new-tokens", "128", "--quiet"], check=True)
    vllm = json.loads(report.read_text())["vllm"]
    return {key: vllm.get(key) for key in ("acceptance_length", "per_depth_acceptance", "tokens_per_target_forward",
                                           "speedup", "greedy_output_matches_target_only", "num_steps")}


def read_curve(run: Path) -> list[dict]:
    """The trainer's held-out evaluations (``metrics.jsonl`` lines of kind ``eval``)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "al_estimate": round(r["acceptance_length_estimate"], 4), "loss": round(r["loss"], 4),
             "depth_agreement": [round(a, 4) for a in r["depth_agreement"]]}
            for r in rows if r.get("kind") == "eval"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--heldout-store", type=Path, required=True)
    parser.add_argument("--store", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--serve", default="4x-data", help="comma list of recipes whose final draft vLLM serves "
                        "on --prompts ('' for none)")
    parser.add_argument("--prompts", type=Path, help="held-out prompts (JSONL, user turns) for --serve")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/recipe_curves.json"))
    args = parser.parse_args(argv)
    stores = dict(s.split("=", 1) for s in args.store)
    records = []
    for name in args.recipes.split(","):
        store_name, extra = RECIPES[name]
        records.append(run_recipe(name, Path(stores[store_name]), extra, target=args.target,
                                  heldout=args.heldout_store, work=args.work))
        if name in args.serve.split(","):
            records[-1]["vllm"] = serve_in_vllm(args.work / name, target=args.target, prompts=args.prompts)
        best = records[-1]["best"]
        print(f"{name}: best held-out AL estimate {best['al_estimate']:.3f} at step {best['step']}", flush=True)
    atomic_write_json(args.out, {"steps": STEPS, "eval_every": EVAL_EVERY, "base_flags": BASE,
                                 "stores": {name: describe_store(Path(path)) for name, path in stores.items()},
                                 "heldout_store": describe_store(args.heldout_store), "records": records})


def describe_store(store: Path) -> dict:
    """Where a store was and what it holds (records, tokens), from its manifest or settings."""
    for name in ("manifest.json", "store.json"):
        if (store / name).exists():
            meta = json.loads((store / name).read_text())
            break
    else:
        meta = {}
    return {"path": str(store), "records": meta.get("num_records"), "tokens": meta.get("num_tokens"),
            "regenerate": meta.get("regenerate")}


if __name__ == "__main__":
    main()
