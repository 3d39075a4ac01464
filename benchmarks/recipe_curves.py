"""Recipe curves: how held-out acceptance grows with training steps, per recipe, on the real model.

    python benchmarks/recipe_curves.py --target DIR --heldout-store HELD --work WORK \\
        --store small=STORE_128_CHATS --store large=STORE_512_CHATS --store sampled=STORE_512_SAMPLED \\
        --recipes 4x-data,4x-data+sampled --serve 4x-data,4x-data+sampled --prompts PROMPTS

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

A recipe is one or more named stores (mixed by ``peagle train``'s repeated ``--store``), extra
``peagle train`` flags and a step count (:data:`RECIPES`); the budget is :data:`BASE` (1-layer
draft, K = 5, vocab 2,048 built on the recipe's first store, 2,048 tokens per step, at most 16
chains per sample). The stores the recipes name:

* ``small``: 128 training prompts answered greedily (``peagle extract --regenerate --temperature 0``);
* ``large``: 512 training prompts answered greedily (quality.py's draft store);
* ``sampled``: the same 512 prompts answered again, sampled (``--temperature 0.7 --seed 1``): twice
  the data for the generation cost of ``large``, as varied as the target's own sampling makes it;
* ``sampled2``, ``sampled3``: the same again with ``--seed 2`` and ``--seed 3`` (four times ``large``);
* ``docs``: teacher-forced text, not the target's answers: 2,000 passages of Python's own
  documentation on this machine (pydoc topics, docstrings) as assistant turns (``peagle extract``
  without ``--regenerate``: ``python benchmarks/docs_chats.py --out docs.jsonl``, then ``peagle extract
  --data docs.jsonl --out DIR --max-seq-len 1024 --samples-per-shard 250 --backend vllm --target T``):
  a prefill per token instead of a generated one, 2.7x cheaper to make, but text the target did not write.

A finished run in ``--work`` (its last eval line at its last step) is reused, so a cut-short
benchmark resumes. JSON out (``--out``): per recipe its command and the curve; the records of
recipes not run this time are kept from the file already there.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from quality_variants import PEAGLE_ONLY_FLAGS

from peagle.pipeline.atomic import atomic_write_json

STEPS = 300
EVAL_EVERY = 25
VOCAB = 2048
BASE = ["--num-layers", "1", "--num-depths", "5", "--draft-vocab-size", str(VOCAB), "--token-budget", "2048",
        "--lr", "3e-3", "--warmup-steps", "30", "--eval-every", str(EVAL_EVERY),
        "--save-every", "0", "--seed", "0", "--num-workers", "1", "--max-anchors", "16"]
"""Today's defaults otherwise (Muon, the EAGLE-3.1 norms, forward KL)."""


@dataclass(frozen=True)
class Recipe:
    stores: tuple[str, ...]
    """Store names (``--store NAME=DIR``), mixed by ``peagle train``; the draft vocab is the first's."""
    flags: tuple[str, ...] = ()
    steps: int = STEPS

    def base_flags(self) -> list[str]:
        """:data:`BASE`, without the flags only P-EAGLE takes when the recipe trains another method
        (``--method``): EAGLE-3 trains every chain."""
        if "--method" not in self.flags or self.flags[self.flags.index("--method") + 1] == "peagle":
            return BASE
        pairs = zip(BASE[::2], BASE[1::2])
        return [word for flag, value in pairs if flag not in PEAGLE_ONLY_FLAGS for word in (flag, value)]


RECIPES: dict[str, Recipe] = {
    "base": Recipe(("small",)),
    "frozen-embeddings": Recipe(("small",), ("--no-train-embeddings",)),
    "4x-data": Recipe(("large",)),
    "4x-data-600": Recipe(("large",), steps=600),  # more steps on the same data: still rising at 300?
    "4x-data+sampled": Recipe(("large", "sampled")),  # twice the answers at the same steps
    "4x-data+sampled-600": Recipe(("large", "sampled"), steps=600),
    "eagle3-4x-data": Recipe(("large",), ("--method", "eagle3")),  # the other method, quality.py's eagle3-k5
    "eagle3-4x-data+sampled": Recipe(("large", "sampled"), ("--method", "eagle3")),
    # four answers to each of the 512 prompts: greedy, and sampled with three seeds
    "4x-data+3sampled-600": Recipe(("large", "sampled", "sampled2", "sampled3"), steps=600),
    "eagle3-4x-data+3sampled": Recipe(("large", "sampled", "sampled2", "sampled3"), ("--method", "eagle3")),
    "eagle3-4x-data+3sampled-600": Recipe(("large", "sampled", "sampled2", "sampled3"), ("--method", "eagle3"),
                                          steps=600),  # still rising at 300?
    # teacher-forced documentation beside the greedy answers, mixed 1:1 like 4x-data+sampled's second store
    "4x-data+docs": Recipe(("large", "docs")),
}


def train_command(name: str, recipe: Recipe, stores: dict[str, Path], *, target: Path, heldout: Path,
                  work: Path) -> list[str]:
    """The `peagle train` arguments of one recipe (without the interpreter)."""
    missing = [s for s in recipe.stores if s not in stores]
    if missing:
        raise SystemExit(f"recipe {name} needs --store {missing[0]}=DIR")
    store_flags = [part for s in recipe.stores for part in ("--store", str(stores[s]))]
    return ["train", *store_flags, "--target", str(target), "--out", str(work / name), *recipe.base_flags(),
            "--max-steps", str(recipe.steps), "--eval-store", str(heldout), *recipe.flags]


def run_recipe(name: str, recipe: Recipe, stores: dict[str, Path], *, target: Path, heldout: Path,
               work: Path) -> dict:
    run = work / name
    args = train_command(name, recipe, stores, target=target, heldout=heldout, work=work)
    curve = read_curve(run)
    if not curve or curve[-1]["step"] != recipe.steps:
        first = stores[recipe.stores[0]]
        if not (first / "vocab" / f"draft-{VOCAB}.json").exists():
            subprocess.run([sys.executable, "-m", "peagle", "vocab", "--store", str(first), "--draft-vocab-size",
                            str(VOCAB), "--quiet"], check=True)
        subprocess.run(["rm", "-rf", str(run)], check=True)
        print(f"$ peagle {shlex.join(args)}", flush=True)
        subprocess.run([sys.executable, "-m", "peagle", *args], check=True)
        curve = read_curve(run)
    return {"recipe": name, "stores": [str(stores[s]) for s in recipe.stores], "steps": recipe.steps,
            "command": shlex.join(["peagle", *args]), "curve": curve,
            "best": max(curve, key=lambda c: c["al_estimate"]) if curve else None}


def merged_records(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each recipe run now replaced (in place) or appended: a run of some recipes keeps
    the others' figures."""
    fresh = {r["recipe"]: r for r in new}
    kept = [fresh.pop(r["recipe"], r) for r in old]
    return kept + [r for r in new if r["recipe"] in fresh]


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
    stores = {name: Path(path) for name, path in (s.split("=", 1) for s in args.store)}
    unknown = [name for name in args.recipes.split(",") if name not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipe {unknown[0]!r}; known: {', '.join(RECIPES)}")
    records = []
    for name in args.recipes.split(","):
        records.append(run_recipe(name, RECIPES[name], stores, target=args.target, heldout=args.heldout_store,
                                  work=args.work))
        records[-1]["heldout_store"] = describe_store(args.heldout_store)  # curves on other stores differ
        if name in args.serve.split(","):
            records[-1]["vllm"] = serve_in_vllm(args.work / name, target=args.target, prompts=args.prompts)
        best = records[-1]["best"]
        print(f"{name}: best held-out AL estimate {best['al_estimate']:.3f} at step {best['step']}", flush=True)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    described = {name: describe_store(path) for name, path in stores.items()}
    atomic_write_json(args.out, {"eval_every": EVAL_EVERY, "base_flags": BASE,
                                 "stores": {**old.get("stores", {}), **described},
                                 "heldout_store": describe_store(args.heldout_store),
                                 "records": merged_records(old.get("records", []), records)})


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
