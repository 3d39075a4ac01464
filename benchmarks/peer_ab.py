"""Peer A/B: drafts from peagle and from speculators 0.9.0, trained on one store with one budget, served by vLLM.

    python benchmarks/peer_ab.py --store S --heldout-store H --target T --prompts P   # the README table, 3 seeds
    python benchmarks/peer_ab.py ... --seeds 3,4          # more seeds (records of earlier seeds are reused)
    python benchmarks/peer_ab.py ... --report-only        # the JSON and table from the finished records
    python benchmarks/peer_ab.py --list                   # the configurations and their flags

The stores, target and prompts are those of the quality benchmark (benchmarks/quality.py makes them:
``--store WORK/store --heldout-store WORK/heldout-store --prompts WORK/data/prompts.jsonl``), and so
is the budget (:class:`quality.Budget`: steps, token budget, draft vocab size, evaluation sizes).
Three configurations (:data:`CONFIGS`), each over the same seeds:

* ``peagle``: ``peagle train`` with the quality benchmark's flags of ``--peagle-variant`` (default
  ``muon-all-norms``: peagle's defaults, Muon and the EAGLE-3.1 norms), 1 layer, K = 5;
* ``speculators-defaults``: speculators' own recipe: ``speculators train --speculator-type peagle``
  with its defaults (:func:`speculators_defaults_flags`), at the same draft vocab size;
* ``speculators-peagle``: speculators' code with peagle's settings: every ``peagle train`` flag of the
  ``peagle`` run that a ``speculators train`` flag expresses (:func:`speculators_peagle_flags`), the
  store's draft vocabulary and mask token. The gap between it and ``peagle`` is implementation, the
  gap between it and ``speculators-defaults`` is recipe.

The speculators drafts are trained by speculators' own code in its own environment
(``.venv-speculators``, made from ``locks/speculators.txt`` by scripts/speculators_venv.sh, never
touching ``.venv``): benchmarks/peer_ab_speculators.py drives its trainer, benchmarks/peer_ab_data.py
is the conversion of the store into its inputs. All three see the same samples (every sample of the
store) and the same number of training positions: a speculators run stops at the first of its steps
where its packed rows reach the positions the ``peagle`` run of the same seed trained. Every draft
is then measured by ``peagle eval`` exactly as the quality benchmark measures its drafts: teacher-
forced chains on the held-out store, our own speculative loop, and vLLM serving its export (peagle's
export, speculators' checkpoint as it saved it) with parallel drafting on, at K = 5, on the same
held-out prompts; greedy outputs are checked equal to the target's.

JSON (``--out``, default benchmarks/results/cpu/peer_ab.json): ``records`` (one per configuration and
seed: ``config``, ``trainer``, ``seed``, ``al_vllm``, ``al_own``, ``al_offline``, ``per_depth`` (vLLM's
P(accepted >= d)) and the other modes', the greedy checks, ``positions`` trained, steps, final loss,
seconds and CPU seconds per stage, the flags), ``summary`` (per configuration: mean, std and standard
error over seeds, and for the speculators configurations ``vs_peagle``: Welch's t-test against
``peagle``), ``settings``. A re-run reuses every finished record in ``--work`` whose flags are
unchanged (a killed benchmark resumes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

from quality import EVAL_K, Budget, Stages, continuation_stats, train_flags
from quality_report import print_peer_table, summarise_peers

from peagle.pipeline.atomic import atomic_write_json
from peagle.pipeline.store import open_store
from peagle.schemas.components import leaves
from peagle.schemas.train_config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
SPECULATORS_VENV = ROOT / ".venv-speculators"
SPECULATORS_TRAINER = ROOT / "benchmarks" / "peer_ab_speculators.py"

CONFIGS = {"peagle": "peagle", "speculators-defaults": "speculators", "speculators-peagle": "speculators"}
"""Configuration -> the trainer that runs it."""

SPECULATORS_CPU = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
                   "--num-workers", "0"]
"""How speculators runs on this CPU, not what it trains (both configurations): its SDPA attention with
the same mask rule as its default flex attention (peagle on CPU uses SDPA too), its eager loss (the
same formula as its fused Triton kernel, which needs a GPU), fp32 compute (its bf16 autocast is a
GPU setting; peagle is run with --compute-dtype float32, though its CPU default is bf16 where the
CPU has native bf16) and no DataLoader worker processes (2 cores)."""

NO_ANCHOR_CAP = 2**31 - 1
"""speculators' ``--max-anchors`` is an int (default 512); peagle's default is no cap."""

COSINE_CYCLES_TO_TENTH = math.acos(-0.8) / (2 * math.pi)
"""speculators' cosine schedule (transformers') decays to 0.5·(1 + cos(2π·c)) of the peak at the last
step; c = 0.3976 ends at 0.1, where peagle's cosine ends (``MIN_LR_RATIO``): the nearest it offers."""

PEAGLE_LOSS = {"forward_kl": "kl_div", "tv": "tv"}

BUDGET_FIELDS = ("train_steps", "token_budget", "draft_vocab_size", "num_prompts", "max_new_tokens", "num_heldout_chats")
"""What this benchmark takes of the quality budget (the rest is how quality.py makes its target and stores)."""


def peagle_settings(flags: list[str]) -> TrainConfig:
    """The ``peagle train`` flags as the TrainConfig they make (every other field at its default)."""
    by_name = {leaf.name: leaf.field for leaf in leaves(TrainConfig)}  # the flags, each part's included
    values: dict = {}
    i = 0
    while i < len(flags):
        name = flags[i][2:].replace("-", "_")
        if name in by_name:
            if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
                values[name] = flags[i + 1]
                i += 2
                continue
            values[name] = True
        elif name.startswith("no_") and name[3:] in by_name:
            values[name[3:]] = False
        else:
            raise SystemExit(f"peer_ab: {flags[i]} is not a `peagle train` flag")
        i += 1
    for name, value in values.items():
        default = by_name[name].default
        if isinstance(value, str):
            kind = type(default) if default is not None and not isinstance(default, (str, tuple)) else None
            values[name] = kind(value) if kind else _number_or_text(value)
    return TrainConfig.from_flags(store=("STORE",), target="TARGET", out="OUT", **values)


def _number_or_text(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def speculators_defaults_flags(budget: Budget, seed: int) -> list[str]:
    """speculators' own P-EAGLE recipe: only the draft type, the draft vocab size (speculators' default
    would be the whole target vocab; its own frequency count picks the ids) and the seed are given."""
    return ["--speculator-type", "peagle", "--draft-vocab-size", str(budget.draft_vocab_size), "--seed", str(seed),
            *SPECULATORS_CPU]


def speculators_peagle_flags(peagle_flags: list[str], mask_token_id: int) -> list[str]:
    """peagle's settings as ``speculators train`` flags, as far as its flags reach.

    Mapped: layers, decoder type (full attention, as peagle's draft), K, r, r_min, the anchor cap, the
    packed row length (``--token-budget``), draft vocab (the store's, by the trainer's
    ``--store-vocab``) and mask token, optimizer (Muon with peagle's rate, scaling and decay; AdamW's
    rate and decay), warmup and a cosine to 10%, the loss, the norms, the seed. Of the two norms before
    ``fc`` speculators takes one (it refuses both together), and vLLM 0.32 serves a speculators
    checkpoint only with ``norm_before_fc``: it reads ``fc_norm`` inside ``transformer_layer_config``,
    where speculators does not write it, and fails to load the weights. So peagle's either or both
    become ``--norm-before-fc``. Not expressible,
    so speculators' own: AdamW's betas (0.999 vs peagle's 0.95) and decay on every parameter,
    which parameters Muon takes (speculators: every 2-D matrix but embeddings and heads, so ``fc``
    too), the anchor cap per packed row rather than per sample, the loss-mask shift, data order
    and COD draws.
    """
    p = peagle_settings(peagle_flags)
    flags = ["--speculator-type", "peagle", "--num-layers", str(p.num_layers), "--draft-arch", p.draft_architecture,
             "--full-attention-indices", *map(str, range(p.num_layers)),
             "--num-depths", str(p.cod.num_depths), "--down-sample-ratio", str(p.cod.down_sample_ratio),
             "--down-sample-ratio-min", str(p.cod.down_sample_ratio_min),
             "--max-anchors", str(p.cod.max_anchors or NO_ANCHOR_CAP), "--total-seq-len", str(p.data.token_budget),
             "--draft-vocab-size", str(p.draft_vocab_size), "--mask-token-id", str(mask_token_id),
             "--optimizer", p.optim.optimizer, "--lr", str(p.optim.lr), "--weight-decay", str(p.optim.weight_decay),
             "--muon-lr", str(p.optim.muon_lr), "--muon-weight-decay", str(p.optim.weight_decay),
             "--muon-adjust-lr-fn", "original", "--scheduler-type", "cosine",
             "--scheduler-warmup-steps", str(p.optim.warmup_steps),
             "--scheduler-num-cosine-cycles", f"{COSINE_CYCLES_TO_TENTH:.6f}", "--loss-fn", PEAGLE_LOSS[p.loss],
             "--norm-before-residual" if p.norm_before_residual else "--no-norm-before-residual",
             "--norm-before-fc" if p.norm_before_fc or p.fc_norm else "--no-norm-before-fc",
             "--seed", str(p.seed), *SPECULATORS_CPU]
    return flags


def make_speculators_venv(stages: Stages) -> Path:
    """The speculators environment, made or checked from its lock (scripts/speculators_venv.sh)."""
    stages.run("speculators-venv", [str(SPECULATORS_VENV)], program=["bash", str(ROOT / "scripts" / "speculators_venv.sh")])
    return SPECULATORS_VENV / "bin" / "python"


def ensure_vocab(stages: Stages, store: Path, draft_vocab_size: int) -> None:
    """peagle's draft vocabulary of the budget's size in the store (built once, by ``peagle vocab``)."""
    if not (store / "vocab" / f"draft-{draft_vocab_size}.json").exists():
        stages.run("vocab", ["vocab", str(store), "--draft-vocab-size", str(draft_vocab_size), "--quiet"])


def run_dir(work: Path, config: str, seed: int) -> Path:
    return work / "runs" / config / f"seed{seed}"


def evaluate(stages: Stages, tag: str, export: Path, run: Path, paths: dict[str, Path], budget: Budget,
             modes: list[str]) -> tuple[dict, float]:
    """``peagle eval`` of one export at K = 5 in ``modes`` (vllm always), the budget's sizes: (report, seconds)."""
    seconds = stages.run(f"eval-{tag}", [
        "eval", str(export), "--target", str(paths["target"]), "--store", str(paths["heldout"]),
        "--prompts", str(paths["prompts"]), "--out", str(run / "report"), "--num-depths", str(EVAL_K),
        "--mode", ",".join(modes), "--max-prompts", str(budget.num_prompts),
        "--max-new-tokens", str(budget.max_new_tokens), "--max-samples", str(budget.num_heldout_chats), "--quiet"])
    return json.loads((run / "report" / "report.json").read_text()), seconds


def acceptance_fields(tag: str, report: dict) -> dict:
    """What a record keeps of an eval report (the quality benchmark's fields; None for a mode not run)."""
    vllm, own, offline = report["vllm"], report.get("online") or {}, report.get("offline") or {}
    if vllm.get("parallel_drafting") is not True:
        raise SystemExit(f"{tag}: vLLM ran without parallel drafting; its acceptance would mean nothing")
    return {"al_vllm": vllm["acceptance_length"], "al_own": own.get("acceptance_length"),
            "al_offline": offline.get("acceptance_length"), "per_depth": vllm["per_depth_acceptance"],
            "per_depth_own": own.get("per_depth_acceptance"), "per_depth_offline": offline.get("per_depth_acceptance"),
            "greedy_output_matches_plain": own.get("greedy_output_matches_plain"),
            "vllm_greedy_matches_target": vllm.get("greedy_output_matches_target_only"),
            "continuations": continuation_stats(report)}


def run_peagle(stages: Stages, work: Path, paths: dict[str, Path], budget: Budget, modes: list[str], flags: list[str],
               seed: int) -> dict:
    run, tag = run_dir(work, "peagle", seed), f"peagle-seed{seed}"
    seconds = {"train": stages.run(f"train-{tag}", ["train", "--store", str(paths["store"]), "--target",
                                                   str(paths["target"]), "--out", str(run), "--eval-store",
                                                   str(paths["heldout"]), "--compute-dtype", "float32", *flags])}
    seconds["export"] = stages.run(f"export-{tag}", ["export", str(run), "--out", str(run / "export"),
                                                     "--speculative-tokens", str(EVAL_K)])
    report, seconds["eval"] = evaluate(stages, tag, run / "export", run, paths, budget, modes)
    rows = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m.get("kind") == "train"]
    return {**acceptance_fields(tag, report), "positions": rows[-1]["tokens_seen"], "steps": rows[-1]["step"],
            "final_loss": rows[-1]["loss"], "seconds": seconds,
            "cpu_seconds": {stage: stages.cpu_seconds[f"{stage}-{tag}"] for stage in seconds}}


def run_speculators(stages: Stages, work: Path, paths: dict[str, Path], budget: Budget, modes: list[str], config: str,
                    flags: list[str], seed: int, positions: int, python: Path) -> dict:
    run, tag = run_dir(work, config, seed), f"{config}-seed{seed}"
    ours = ["--store", str(paths["store"]), "--target", str(paths["target"]), "--out", str(run / "train"),
            "--tokens", str(positions)] + (["--store-vocab"] if config == "speculators-peagle" else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    seconds = {"train": stages.run(f"train-{tag}", [str(SPECULATORS_TRAINER), *ours, "--", *flags],
                                   program=[str(python)], env=env)}
    trained = json.loads((run / "train" / "run.json").read_text())
    report, seconds["eval"] = evaluate(stages, tag, run / "train" / "export", run, paths, budget, modes)
    rows = [json.loads(line)["train"] for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return {**acceptance_fields(tag, report), "positions": trained["positions"], "steps": trained["steps"],
            "epochs": trained["epochs"], "final_loss": rows[-1]["loss"] if rows else None,
            "mask_token_id": trained["mask_token_id"], "draft_arch": trained["draft_arch"],
            "speculators_flags": trained["flags"], "seconds": seconds,
            "cpu_seconds": {stage: stages.cpu_seconds[f"{stage}-{tag}"] for stage in seconds}}


def run_one(stages: Stages, work: Path, paths: dict[str, Path], budget: Budget, modes: list[str], config: str,
            flags: list[str], seed: int, positions: int | None, python: Path | None, report_only: bool) -> dict:
    """Train and evaluate one (configuration, seed); the record is reused while its flags are the same."""
    record_path = run_dir(work, config, seed) / "record.json"
    key = {"train_flags": flags, "positions_wanted": positions, "eval": eval_settings(budget, modes)}
    if record_path.exists():
        old = json.loads(record_path.read_text())
        if all(old.get(k) == v for k, v in key.items()):
            print(f"reusing {record_path}", flush=True)
            return old
        if not report_only:  # made with other flags: train afresh (a run without a record resumes instead)
            shutil.rmtree(record_path.parent)
    if report_only:
        raise SystemExit(f"--report-only: {record_path} is missing or was made with other flags than {config!r} has now")
    started = time.monotonic()
    if CONFIGS[config] == "peagle":
        measured = run_peagle(stages, work, paths, budget, modes, flags, seed)
    else:
        measured = run_speculators(stages, work, paths, budget, modes, config, flags, seed, positions, python)
    record = {"config": config, "trainer": CONFIGS[config], "seed": seed, **key, **measured,
              "wall_seconds": time.monotonic() - started}
    atomic_write_json(record_path, record)
    others = ", ".join(f"{mode} {record[key]:.3f}" for mode, key in (("own", "al_own"), ("offline", "al_offline"))
                       if record[key] is not None)
    print(f"{config} seed {seed}: AL vLLM {record['al_vllm']:.3f} ({others}); train {record['seconds']['train']:.0f} s, "
          f"eval {record['seconds']['eval']:.0f} s, {record['wall_seconds']:.0f} s in all", flush=True)
    return record


def eval_settings(budget: Budget, modes: list[str]) -> dict:
    return {"k": EVAL_K, "modes": modes, "num_prompts": budget.num_prompts, "max_new_tokens": budget.max_new_tokens,
            "max_samples": budget.num_heldout_chats}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, help="training store (the quality benchmark's WORK/store)")
    ap.add_argument("--heldout-store", type=Path, help="held-out store for teacher-forced chains (WORK/heldout-store)")
    ap.add_argument("--target", type=Path, help="the stores' target model directory")
    ap.add_argument("--prompts", type=Path, help="held-out prompts, JSONL of messages (WORK/data/prompts.jsonl)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configurations (peagle is always "
                    "run: the others are compared with it and see its number of training positions)")
    ap.add_argument("--seeds", default="0,1,2", help="comma list of training seeds")
    ap.add_argument("--peagle-variant", default="muon-all-norms", help="the quality benchmark's variant whose "
                    "`peagle train` flags the peagle configuration uses (and speculators-peagle maps)")
    ap.add_argument("--train-steps", type=int, help="peagle's training steps (default: the quality budget's)")
    ap.add_argument("--token-budget", type=int, help="peagle's positions per step (default: the quality budget's)")
    ap.add_argument("--draft-vocab-size", type=int, help="draft vocab size of every draft (default: the quality budget's)")
    ap.add_argument("--num-prompts", type=int, help="held-out prompts to generate for (default: the quality budget's)")
    ap.add_argument("--max-new-tokens", type=int, help="tokens generated per prompt (default: the quality budget's)")
    ap.add_argument("--eval-modes", default="offline,online,vllm", help="`peagle eval` modes (vllm is always run; "
                    "online, our own loop with the HF target, is the slowest on CPU)")
    ap.add_argument("--work", type=Path, default=Path("peer-ab-work"), help="working directory, reused on re-runs")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/peer_ab.json"))
    ap.add_argument("--report-only", action="store_true", help="run nothing: the JSON and table from the records "
                    "already finished in --work (configurations and seeds without a record are left out)")
    ap.add_argument("--list", action="store_true", help="print each configuration's flags (seed 0) and exit")
    ap.add_argument("--verbose", action="store_true", help="stage output on this terminal instead of log files")
    args = ap.parse_args(argv)
    # No anchor cap: speculators caps anchors per packed row, peagle per sample, so any cap would
    # train the two on different chains; uncapped, both train every chain COD draws.
    budget = replace(Budget(), max_anchors=None)
    overrides = {"train_steps": args.train_steps, "token_budget": args.token_budget,
                 "draft_vocab_size": args.draft_vocab_size, "num_prompts": args.num_prompts,
                 "max_new_tokens": args.max_new_tokens}
    budget = replace(budget, **{k: v for k, v in overrides.items() if v is not None})
    configs = ["peagle"] + [c for c in args.configs.split(",") if c and c != "peagle"]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    modes = list(dict.fromkeys([m for m in args.eval_modes.split(",") if m] + ["vllm"]))

    def flags_of(config: str, seed: int, mask_token_id: int) -> list[str]:
        peagle = train_flags(args.peagle_variant, budget, seed)
        return {"peagle": peagle, "speculators-defaults": speculators_defaults_flags(budget, seed),
                "speculators-peagle": speculators_peagle_flags(peagle, mask_token_id)}[config]

    if args.list:
        for config in configs:
            print(f"{config} ({CONFIGS[config]} train): {' '.join(flags_of(config, 0, 0))}")
        return {}
    missing = [name for name in ("store", "heldout_store", "target", "prompts") if getattr(args, name) is None]
    if missing:
        raise SystemExit(f"peer_ab: pass {', '.join('--' + m.replace('_', '-') for m in missing)}")
    paths = {"store": args.store.resolve(), "heldout": args.heldout_store.resolve(), "target": args.target.resolve(),
             "prompts": args.prompts.resolve()}
    work = args.work.resolve()
    stages = Stages(work, args.verbose)
    started = time.monotonic()
    store = open_store(paths["store"])
    python = None
    if not args.report_only:
        ensure_vocab(stages, paths["store"], budget.draft_vocab_size)
        if any(CONFIGS[c] == "speculators" for c in configs):
            t0 = time.monotonic()
            python = make_speculators_venv(stages)
            print(f"speculators environment: {time.monotonic() - t0:.0f} s", flush=True)
    result: dict = {
        "settings": {"budget": {k: v for k, v in asdict(budget).items() if k in BUDGET_FIELDS},
                     "eval": eval_settings(budget, modes), "peagle_variant": args.peagle_variant,
                     "configs": {c: flags_of(c, 0, store.settings.mask_token_id) for c in configs},
                     "seeds": seeds, **{name: str(path) for name, path in paths.items()},
                     "store_samples": store.num_samples, "store_tokens": store.num_tokens},
        "records": [],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_start": os.getloadavg()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in seeds:  # seed-major: a run cut short still compares every configuration on the seeds it finished
        positions = None
        for config in configs:
            if args.report_only and not (run_dir(work, config, seed) / "record.json").exists():
                continue
            if CONFIGS[config] == "speculators" and positions is None:
                break  # --report-only without the peagle record of this seed: nothing to compare with
            rec = run_one(stages, work, paths, budget, modes, config,
                          flags_of(config, seed, store.settings.mask_token_id), seed, positions, python, args.report_only)
            if config == "peagle":
                positions = rec["positions"]
            result["records"].append(rec)
            result["summary"] = summarise_peers(result["records"])
            atomic_write_json(args.out, result)  # partial results stay readable while later runs go on
    result["machine"]["load_average_end"] = os.getloadavg()
    result["wall_seconds"] = time.monotonic() - started
    result["summary"] = summarise_peers(result["records"]) if result["records"] else {}
    atomic_write_json(args.out, result)
    print_peer_table(result["summary"])
    print(f"results: {args.out} ({result['wall_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
