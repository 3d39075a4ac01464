"""The data-scaling row on 2 CPU cores (issue 36's CPU half): the 1-layer P-EAGLE draft trained with
equal steps on a quarter, a half and all of the target's answers to new prompts, each measured in vLLM
on the held-out prompts.

    python benchmarks/data_scaling.py --work WORK --out benchmarks/results/cpu/data_scaling.json

Every step is the product's own command, skipped when its output is already there (a killed run
resumes; the stores are handed to ``peagle extract`` every time, as it finishes a part-made store or
says "nothing to do"). What it does and why:

* **Prompts**: the templated generator's training prompts (first turn only, one answer each) and the
  target's own (``peagle prompts``, Magpie: the chat template up to the user's text, sampled), with
  every held-out subject's phrases and every held-out prompt excluded; deduplicated; then
  :func:`real_scale.leaks` checks the final list again and the run refuses to go on unless it finds
  nothing. They are ordered by the sha256 of their text and cut 1:1:2 into parts ``a``, ``b``, ``c``,
  so the three points train on ``a``, ``a+b`` and ``a+b+c``: each point's data holds the smaller's.
  ``--more-magpie-prompts N`` adds a fourth point, ``double``, on ``a+b+c+d``: part ``d`` is N more
  of the target's prompts (chunks of their own seeds, 100 on), less any already in ``a+b+c`` and
  leak-checked alike, so the first three parts, their stores and their drafts are reused as they are.
* **Answers**: ``peagle extract --regenerate --temperature 0`` of each part (greedy: the evaluation
  decodes greedily, so the draft learns the text it will be asked to predict), and the held-out store
  (the 64 held-out prompts of quality.py, greedy).
* **Drafts**: one recipe (``recipe_curves.BASE``: K = 5, vocab 2,048 built on part ``a``, 2,048 tokens
  a step, at most 16 chains a sample) for ``--steps`` steps on each point, the held-out curve every
  25 steps, then exported and served in vLLM at K = 5 on 32 held-out prompts (128 new tokens), as
  ``recipe_curves.py --serve`` does for its rows in docs/quality.md.

JSON out: the prompts (counts, leak check), each store (samples, tokens, generated tokens/s), each
point's data tokens, training command, curve and vLLM figures; a run of other points or ``--steps``
keeps the records of earlier ones (``--steps 1200 --points all,double`` adds two rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from real_scale import (distinct_first_turns, extract_rates, heldout_chats, heldout_phrases, leaks,  # noqa: E402
                        normalised, read_jsonl, refuse_leaks, split_prompts, templated_train_prompts, write_jsonl)
from recipe_curves import Recipe, describe_store, merged_records, run_recipe, serve_in_vllm  # noqa: E402

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402
from peagle.pipeline.store import list_commits  # noqa: E402

PARTS = {"a": 1, "b": 1, "c": 2}
"""Parts of the training prompts (shares); the points train on a, a+b, a+b+c."""
PROMPT_CHUNK = 3200
"""``peagle prompts`` writes its file whole at the end: one run per chunk of this many prompts."""
POINTS = {"quarter": ("a",), "half": ("a", "b"), "all": ("a", "b", "c"), "double": ("a", "b", "c", "d")}
MORE_SEED = 100
"""The seed of part d's first prompt chunk (the next ones count up): apart from the first parts' seeds."""


def run(name: str, args: list[str], work: Path, *, append: bool = False) -> float:
    """One ``peagle`` command, logged to WORK/logs/NAME.log (``append``: after the earlier runs' lines,
    for a resumable command whose earlier runs did part of the work); its seconds. A failure stops the run."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] $ peagle {shlex.join(args)}", flush=True)
    started = time.time()
    with open(work / "logs" / f"{name}.log", "a" if append else "w") as log:
        rc = subprocess.run([sys.executable, "-m", "peagle", *args], stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (work / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"{name} failed (rc {rc}): {' | '.join(tail)}")
    return round(time.time() - started, 1)


def make_prompts(work: Path, target: Path, magpie: int, prompt_args: list[str], more: int = 0) -> dict:
    """The held-out files, the target's own prompts and the parts' prompt files (part d with ``more``);
    what they hold."""
    data = work / "data"
    heldout = heldout_chats(64)
    write_jsonl(data / "heldout.jsonl", heldout)
    write_jsonl(data / "eval-prompts.jsonl", heldout[:32])
    write_jsonl(data / "heldout-all.jsonl", heldout_chats(10_000))
    phrases = heldout_phrases()
    (data / "heldout-phrases.txt").write_text("".join(p + "\n" for p in phrases))
    runs, written = write_chunks(work, target, "magpie", magpie, 0, prompt_args)
    templated = templated_train_prompts()
    chats = distinct_first_turns(written + templated)
    checked = leaks(written, templated, phrases)
    refuse_leaks(checked)
    sizes = {name: len(read_jsonl(path)) for name, path in split_prompts(chats, work, PARTS).items()}
    prompts = {"target_written": len(written), "templated": len(templated), "training_prompts": len(chats),
               "parts": sizes, "leaks": checked, "prompt_runs": runs}
    if more:
        prompts["more"] = make_more_prompts(work, target, more, chats, prompt_args, phrases)
    return prompts


def write_chunks(work: Path, target: Path, stem: str, wanted_total: int, first_seed: int,
                 prompt_args: list[str]) -> tuple[list[dict], list[dict]]:
    """``wanted_total`` target-written prompts, made in chunks (WORK/data/STEM-I.jsonl, seed
    first_seed + I) so a bigger run reuses a smaller's files; the runs' facts and the prompts."""
    data, runs, written = work / "data", [], []
    for chunk in range(-(-wanted_total // PROMPT_CHUNK)):
        out = data / f"{stem}-{chunk}.jsonl"
        wanted = min(PROMPT_CHUNK, wanted_total - chunk * PROMPT_CHUNK)
        name = f"prompts-{chunk}" if stem == "magpie" else f"prompts-{stem}-{chunk}"  # the first runs' log names
        runs.append({"file": out.name, "seed": first_seed + chunk})
        if not out.exists():
            runs[-1]["seconds"] = run(name, [
                "prompts", "--target", str(target), "--out", str(out), "--seed", str(first_seed + chunk),
                "--num-prompts", str(wanted), "--exclude-phrases", str(data / "heldout-phrases.txt"),
                "--exclude-prompts", str(data / "heldout-all.jsonl"), *prompt_args], work)
        chunk_prompts = read_jsonl(out)
        if len(chunk_prompts) != wanted:  # a last chunk of a smaller run: its seed's file is not this run's
            raise SystemExit(f"{out} holds {len(chunk_prompts):,} prompts where this run wants {wanted:,}: "
                             "move it away and run again to write it anew")
        written += chunk_prompts
        log = work / "logs" / f"{name}.log"
        if log.exists():  # its last line: prompts kept, samples, drops by reason, tokens/s
            runs[-1]["summary"] = log.read_text(errors="replace").strip().splitlines()[-1]
    return runs, written


def make_more_prompts(work: Path, target: Path, more: int, first_parts: list[dict], prompt_args: list[str],
                      phrases: list[str]) -> dict:
    """Part d (WORK/data/prompts-d.jsonl): ``more`` target-written prompts less the first parts' own."""
    runs, written = write_chunks(work, target, "magpie-more", more, MORE_SEED, prompt_args)
    taken = {normalised(c["messages"][0]["content"]) for c in first_parts}
    distinct = distinct_first_turns(written)
    part = [c for c in distinct if normalised(c["messages"][0]["content"]) not in taken]
    checked = leaks(part, [], phrases)
    refuse_leaks(checked)
    write_jsonl(work / "data" / "prompts-d.jsonl", part)
    return {"target_written": len(written), "already_in_first_parts": len(distinct) - len(part),
            "parts": {"d": len(part)}, "leaks": checked, "prompt_runs": runs}


def extract_args(data: Path, out: Path, target: Path, answer_args: list[str]) -> list[str]:
    return ["extract", "--data", str(data), "--out", str(out), "--target", str(target), "--regenerate",
            "--temperature", "0", "--max-new-tokens", "256", "--max-seq-len", "1024", "--samples-per-shard", "1024",
            "--seed", "0", *answer_args]


def supervised_tokens(store: Path) -> int | None:
    """The supervised (answer) tokens a store holds, from its shards' commit records: a store made
    over several runs has no one closing line that counts them all."""
    records = list_commits(store) if (store / "commits").is_dir() else []
    return sum(r.num_supervised_tokens for r in records) if records else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/data_scaling.json"))
    parser.add_argument("--magpie-prompts", type=int, default=4300, help="prompts the target writes itself")
    parser.add_argument("--more-magpie-prompts", type=int, default=0, help="prompts the target writes for part d "
                        "and the 'double' point (0: no part d)")
    parser.add_argument("--steps", type=int, default=600, help="training steps of every point (equal steps)")
    parser.add_argument("--points", default=None, help="comma list of " + ", ".join(POINTS) + " (default: all but "
                        "double, and double too with --more-magpie-prompts)")
    parser.add_argument("--prompt-args", default="--backend vllm --dtype bfloat16 --batch-size 256 --max-new-tokens 96",
                        help="extra `peagle prompts` flags")
    parser.add_argument("--answer-args", default="--backend vllm --dtype bfloat16 --vllm-engine-args "
                        "'{\"max_num_seqs\": 128, \"max_num_batched_tokens\": 131072}'",
                        help="extra `peagle extract` flags of the answers (every store)")
    parser.add_argument("--stores-only", action="store_true", help="make the prompts and the stores, train nothing "
                        "(the data of a longer run, e.g. benchmarks/convergence.py's)")
    args = parser.parse_args(argv)
    from peagle.model.target.packaged import fetch_target

    points = (args.points or ",".join(p for p in POINTS if p != "double" or args.more_magpie_prompts)).split(",")
    if "double" in points and not args.more_magpie_prompts:
        raise SystemExit("the double point trains on part d: give --more-magpie-prompts N")
    work, target = args.work, fetch_target("smollm2")
    prompts = make_prompts(work, target, args.magpie_prompts, shlex.split(args.prompt_args), args.more_magpie_prompts)
    answer_args = shlex.split(args.answer_args)
    stores, seconds = {}, {}
    for name in ["heldout", *PARTS, *(["d"] if args.more_magpie_prompts else [])]:
        store = work / "stores" / name
        source = work / "data" / ("heldout.jsonl" if name == "heldout" else f"prompts-{name}.jsonl")
        # Always handed to extract: it finishes a store an earlier run left part-made (a manifest
        # lists committed shards only, so its presence says nothing about the rest) or says
        # "nothing to do"; the seconds are kept for a store this run started.
        started_here = not (store / "manifest.json").exists()
        took = run(f"extract-{name}", extract_args(source, store, target, answer_args), work, append=True)
        if started_here:
            seconds[name] = took
        stores[name] = store
    facts = {name: {**describe_store(path), **extract_rates(work / "logs" / f"extract-{name}.log"),
                    "supervised_tokens": supervised_tokens(path),
                    "seconds": seconds.get(name)} for name, path in stores.items()}
    if args.stores_only:
        print(json.dumps({"prompts": prompts, "stores": facts}, indent=1), flush=True)
        return
    old = json.loads(args.out.read_text()).get("records", []) if args.out.exists() else []
    settings = {"steps": args.steps, "prompt_args": args.prompt_args, "answer_args": args.answer_args,
                "magpie_prompts": args.magpie_prompts, "more_magpie_prompts": args.more_magpie_prompts,
                "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()}}
    records = []
    for point in points:
        recipe = Recipe(POINTS[point], steps=args.steps)
        record = run_recipe(f"{point}-{args.steps}", recipe, stores, target=target, heldout=stores["heldout"],
                            work=work / "runs")
        record["point"] = point
        record["data_tokens"] = sum(facts[s]["tokens"] or 0 for s in POINTS[point])
        record["data_samples"] = sum(facts[s]["records"] or 0 for s in POINTS[point])
        record["supervised_tokens"] = sum(facts[s]["supervised_tokens"] or 0 for s in POINTS[point])
        record["vllm"] = serve_in_vllm(work / "runs" / record["recipe"], target=target,
                                       prompts=work / "data" / "eval-prompts.jsonl")
        records.append(record)
        print(f"{point}: {record['supervised_tokens']:,} supervised tokens, {args.steps} steps: AL in vLLM "
              f"{record['vllm']['acceptance_length']:.3f}", flush=True)
        atomic_write_json(args.out, {"prompts": prompts, "stores": facts, "settings": settings,  # other runs' kept
                                     "records": merged_records(old, records)})

if __name__ == "__main__":
    main()
