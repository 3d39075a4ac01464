"""Which of a few Ks serves a draft fastest in vLLM, measured fairly: every K in engine pairs, in turns.

    python benchmarks/k_pairs.py benchmarks/results/cpu/drafts/eagle3-half-step2400 --ks 4 5 --rounds 3 \\
        --work /work/runs/kpairs-e3 --out benchmarks/results/cpu/k_pairs_eagle3_step2400.json

Each K's export is served in ``--rounds`` engine pairs (the draft's engine, then the target's alone:
one ``peagle eval --mode vllm``), the Ks taken in turns round by round so a drift of the machine
touches every K alike; compiled engines, bf16, one request at a time, data_scaling.py's held-out
prompts (16 x 128 tokens), as k_check.sh serves them.

Why: k_check.sh compares the recommended K's three pairs with K = 5's single pair, measured in
another process state (after our loop, in the same eval), and on 2 cores the target alone reads
±10 % from one engine start to the next: more than the few percent eval predicts one K gains on
another. The target alone does not depend on K, so every pair's target run estimates the same
speed; the summary divides each K's median draft speed by the median of all of them
(``speedup_pooled``), beside the median of the pairs' own ratios (``speedup_median``).

DRAFT: a training checkpoint, an export, or a committed draft without the target's embedding
(``peagle export`` makes it whole with SmolLM2's). A report already in WORK is not measured again,
so a killed run, re-run, serves only what is missing. ~7 minutes a pair on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from convergence import PEAGLE  # noqa: E402
from real_scale import heldout_chats, write_jsonl  # noqa: E402

from peagle.model.packaged_target import fetch_target  # noqa: E402
from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

REPORT_DIR = re.compile(r"k(\d+)-r(\d+)")
"""WORK/kK-rR: K's engine pair of round R."""


def serve(draft: Path, work: Path, ks: list[int], rounds: int) -> None:
    """Every K's export (made once), then ``rounds`` rounds of one engine pair per K."""
    target = fetch_target("smollm2")
    prompts = work / "eval-prompts.jsonl"
    if not prompts.exists():  # data_scaling.py's eval-prompts.jsonl: the first 32 of its 64 held-out chats
        write_jsonl(prompts, heldout_chats(64)[:32])
    for k in ks:
        if not (work / f"export-k{k}").is_dir() and subprocess.run(
                [*PEAGLE, "export", str(draft), "--target", str(target), "--out", str(work / f"export-k{k}"),
                 "--speculative-tokens", str(k)]).returncode:
            raise SystemExit(f"peagle export of {draft} at K = {k} failed (its line is above)")
    for r in range(1, rounds + 1):
        for k in ks:
            out = work / f"k{k}-r{r}"
            if not (out / "report.json").exists():
                pair(work / f"export-k{k}", k, target=target, prompts=prompts, out=out)


def pair(export: Path, k: int, *, target: Path, prompts: Path, out: Path, attempts: int = 2) -> None:
    """One engine pair (``peagle eval --mode vllm``), tried again once if a signal killed it: vLLM's
    compiled engine on CPU sometimes aborts with ``Fatal Python error: Cannot recover from stack
    overflow`` (a tensor formatted during garbage collection recursing through torch's ``item``
    decomposition; 2 of ~10 compiled evals on 2026-11-29). A report is written whole or not at all."""
    command = [*PEAGLE, "eval", str(export), "--target", str(target), "--prompts", str(prompts), "--max-prompts",
               "16", "--max-new-tokens", "128", "--target-dtype", "bfloat16", "--quiet", "--vllm-compile", "--mode",
               "vllm", "--num-depths", str(k), "--out", str(out)]
    for attempt in range(1, attempts + 1):
        rc = subprocess.run(command).returncode
        if rc == 0:
            return
        if rc > 0 or attempt == attempts:  # an error of its own, or a second crash: not the engine's luck
            raise SystemExit(f"peagle eval for {out.name} failed (rc {rc})")
        print(f"{out.name}: the engine died by signal {-rc}; once more", flush=True)


def summarise(work: Path) -> dict:
    """Per K its pairs, the median of their ratios, and its median draft speed over the pooled target's."""
    runs: dict[int, list[dict]] = {}
    for report in sorted(work.glob("k*-r*/report.json")):
        found = REPORT_DIR.fullmatch(report.parent.name)
        if not found:
            continue
        vllm = json.loads(report.read_text())["vllm"]
        c1 = vllm["speed"]["concurrency_1"]
        runs.setdefault(int(found.group(1)), []).append(
            {"round": int(found.group(2)), "acceptance_length": vllm["acceptance_length"],
             "spec_tokens_per_second": c1["spec_tokens_per_second"],
             "plain_tokens_per_second": c1["plain_tokens_per_second"], "speedup": c1["speedup"],
             "enforce_eager": vllm["settings"].get("enforce_eager")})
    if not runs:
        raise SystemExit(f"no engine pair's report in {work}")
    plain = [r["plain_tokens_per_second"] for rs in runs.values() for r in rs]
    pooled = statistics.median(plain)
    by_k = {}
    for k, rs in sorted(runs.items()):
        spec = statistics.median(r["spec_tokens_per_second"] for r in rs)
        by_k[str(k)] = {"runs": sorted(rs, key=lambda r: r["round"]), "spec_tokens_per_second_median": spec,
                        "speedup_median": statistics.median(r["speedup"] for r in rs), "speedup_pooled": spec / pooled}
    return {"plain_tokens_per_second_pooled": pooled, "plain_tokens_per_second_runs": plain, "by_k": by_k}


def describe(summary: dict) -> list[str]:
    plain = summary["plain_tokens_per_second_runs"]
    lines = [f"target alone: median {summary['plain_tokens_per_second_pooled']:.1f} tokens/s over {len(plain)} "
             f"engine starts ({min(plain):.1f}-{max(plain):.1f})"]
    for k, row in summary["by_k"].items():
        lines.append(f"K = {k}: AL {row['runs'][0]['acceptance_length']:.3f}, draft "
                     f"{row['spec_tokens_per_second_median']:.1f} tokens/s, {row['speedup_pooled']:.2f}x the pooled "
                     "target; pairs " + " / ".join(f"{r['speedup']:.2f}" for r in row["runs"])
                     + f" (median {row['speedup_median']:.2f}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("draft", type=Path, help="a checkpoint, an export, or a committed draft (drafts/NAME)")
    parser.add_argument("--work", type=Path, required=True, help="exports and one report per engine pair")
    parser.add_argument("--out", type=Path, required=True, help="the summary (JSON)")
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 5], help="the Ks to serve (default: 4 5)")
    parser.add_argument("--rounds", type=int, default=3, help="engine pairs per K (default: 3)")
    args = parser.parse_args()
    if not args.draft.exists():
        raise SystemExit(f"{args.draft} does not exist")
    if args.rounds < 1 or any(k < 1 for k in args.ks):
        raise SystemExit("--rounds and every --ks must be >= 1")
    args.work.mkdir(parents=True, exist_ok=True)
    serve(args.draft, args.work, args.ks, args.rounds)
    summary = {"draft": str(args.draft), "ks": args.ks, "rounds": args.rounds, **summarise(args.work)}
    atomic_write_json(args.out, summary)
    print("\n".join(describe(summary)))


if __name__ == "__main__":
    main()
