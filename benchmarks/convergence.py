"""Drafts trained to convergence on 2 CPU cores, measured in vLLM at checkpoints along the way.

    python benchmarks/data_scaling.py --work /work/runs/ds --more-magpie-prompts 5400 --stores-only   # the data
    python benchmarks/convergence.py --work /work/runs/ds --name peagle-double --method peagle \\
        --points double --steps 13500 --serve-every 1350                                            # hours
    python benchmarks/convergence.py --work /work/runs/ds --report-only                             # JSON again

One run per ``--name``: `peagle train` on data_scaling.py's stores (``--points``: its parts; the
draft vocab of part ``a``; each part weighted by its samples, so every sample is as likely as any
other), the recipe of recipe_curves.py's ``BASE`` but the steps, with every
``--serve-every`` steps a checkpoint that this script exports and serves in vLLM at K = 5 on the 32
held-out prompts (``peagle eval --mode vllm``: AL, per-depth acceptance, tokens/s with and without
the draft one request at a time and all at once). While a checkpoint is served the trainer is
paused (SIGSTOP, then SIGCONT), so the two never share the 2 cores and every speed figure is a
quiet one. Both methods train with ``--no-train-embeddings`` (EAGLE-3's own choice; for P-EAGLE
measured equal in docs/quality.md), so an export travels without the target's embedding
(``peagle export SOURCE --without-target-embedding``; back: ``peagle export STRIPPED --target T``).

Killed at any point, the same command resumes: `peagle train` resumes exactly from its newest
checkpoint, and checkpoints already served are not served again (their reports stay under
WORK/convergence/NAME/served/). ``--steps`` may grow on a resume (the cosine is re-timed from there).

JSON out (``--out``): per run its train command, the held-out estimate curve (metrics.jsonl) and the
served checkpoints with their epochs of data; beside it (same name, .png) the curves against epochs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from data_scaling import POINTS  # noqa: E402
from recipe_curves import BASE, VOCAB, describe_store, read_curve  # noqa: E402

from peagle.pipeline.atomic import atomic_write_bytes, atomic_write_json  # noqa: E402

PEAGLE = [sys.executable, "-m", "peagle"]
SERVED_KEYS = ("acceptance_length", "per_depth_acceptance", "tokens_per_target_forward", "speed",
               "greedy_output_matches_target_only", "num_steps")


def train_args(args: argparse.Namespace, target: Path, run: Path) -> list[str]:
    # weighted by their samples: every sample equally likely (equal weights would over-draw the small parts)
    stores = [part for p in parts_of(args)
              for part in ("--store", f"{args.work / 'stores' / p}:{describe_store(args.work / 'stores' / p)['records']}")]
    pairs = dict(zip(BASE[::2], BASE[1::2]))  # recipe_curves' budget, flag -> value
    del pairs["--save-every"]  # BASE saves at the end only
    if args.method == "eagle3":  # EAGLE-3 trains every chain: no P-EAGLE COD flags, as recipe_curves does
        del pairs["--max-anchors"]
    pairs.update({"--method": args.method, "--max-steps": str(args.steps), "--save-every": str(args.serve_every),
                  "--keep-checkpoints": "2", "--eval-store": str(args.work / "stores" / "heldout")})
    extra = shlex.split(args.extra)
    for flag in extra[::2]:  # an --extra flag replaces the recipe's own (e.g. --token-budget 4096)
        pairs.pop(flag, None)
    # --no-train-embeddings: the target's rows, frozen, so the export travels without them
    return ["train", *stores, "--target", str(target), "--out", str(run), *[w for pair in pairs.items() for w in pair],
            "--no-train-embeddings", *extra]


def parts_of(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(p for point in args.points.split(",") for p in POINTS[point])


def checkpoints(run: Path) -> list[Path]:
    found = [p for p in (run / "checkpoints").glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-").split(".")[0]))


def serve(checkpoint: Path, served: Path, *, target: Path, prompts: Path, dtype: str) -> dict:
    """Export one checkpoint and measure it in vLLM (its report reused when there)."""
    if not (served / "report" / "report.json").exists():
        subprocess.run([*PEAGLE, "export", str(checkpoint), "--out", str(served / "export"), "--speculative-tokens",
                        "5"], check=True, stdout=subprocess.DEVNULL)
    return measure(served / "export", prompts, served / "report", target=target, dtype=dtype)


def measure(export: Path, prompts: Path, report_dir: Path, *, target: Path, dtype: str, num_prompts: int = 32) -> dict:
    """An export in vLLM at K = 5 on ``prompts`` (128 new tokens each; its report reused when there):
    the served facts every served checkpoint records (prompt_kind.py measures the same way)."""
    report = report_dir / "report.json"
    if not report.exists():
        subprocess.run([*PEAGLE, "eval", str(export), "--target", str(target), "--prompts", str(prompts),
                        "--out", str(report_dir), "--num-depths", "5", "--mode", "vllm", "--max-prompts",
                        str(num_prompts), "--max-new-tokens", "128", "--target-dtype", dtype, "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)
    vllm = json.loads(report.read_text())["vllm"]
    return {key: vllm.get(key) for key in SERVED_KEYS}


def pause(process: subprocess.Popen, sig: int) -> None:
    """SIGSTOP / SIGCONT the trainer and its DataLoader workers (one process group)."""
    if process.poll() is None:
        os.killpg(process.pid, sig)


def run_one(args: argparse.Namespace, target: Path) -> None:
    home = args.work / "convergence" / args.name
    run, log = home / "run", home / "train.log"
    home.mkdir(parents=True, exist_ok=True)
    command = train_args(args, target, run)
    (home / "command.txt").write_text(shlex.join(["peagle", *command]) + "\n")
    first = args.work / "stores" / parts_of(args)[0]
    if not (first / "vocab" / f"draft-{VOCAB}.json").exists():
        subprocess.run([*PEAGLE, "vocab", "--store", str(first), "--draft-vocab-size", str(VOCAB), "--quiet"], check=True)
    print(f"[{time.strftime('%H:%M:%S')}] $ peagle {shlex.join(command)}  (log: {log})", flush=True)
    with open(log, "a") as out:
        trainer = subprocess.Popen([*PEAGLE, *command], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            finished = trainer.poll() is not None
            for ckpt in checkpoints(run):
                served = home / "served" / ckpt.name
                if (served / "report" / "report.json").exists():
                    continue
                pause(trainer, signal.SIGSTOP)
                try:
                    result = serve(ckpt, served, target=target, prompts=args.work / "data" / "eval-prompts.jsonl",
                                   dtype=args.eval_dtype)
                finally:
                    pause(trainer, signal.SIGCONT)
                speed = (result.get("speed") or {}).get("concurrency_1") or {}
                print(f"[{time.strftime('%H:%M:%S')}] {args.name} {ckpt.name}: AL in vLLM "
                      f"{result['acceptance_length']:.3f}, {speed.get('speedup') or 0:.2f}x one request at a time",
                      flush=True)
            if finished:
                break
            time.sleep(20)
    finally:
        pause(trainer, signal.SIGCONT)
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGTERM)
    if trainer.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"training stopped (rc {trainer.returncode}): {' | '.join(tail)}")


def record(home: Path, work: Path) -> dict:
    """What one run holds now: its command, curve, served checkpoints (with epochs of its data)."""
    run, log = home / "run", home / "train.log"
    found = re.findall(r"(\d+) batches/epoch/rank", log.read_text(errors="replace")) if log.exists() else []
    batches = int(found[-1]) if found else None
    served = []
    for path in sorted((home / "served").glob("step-*/report/report.json"),
                       key=lambda p: int(p.parent.parent.name.removeprefix("step-"))):
        step = int(path.parent.parent.name.removeprefix("step-"))
        vllm = json.loads(path.read_text())["vllm"]
        served.append({"step": step, "epochs": round(step / batches, 2) if batches else None,
                       **{k: vllm.get(k) for k in SERVED_KEYS}})
    command = (home / "command.txt").read_text().strip() if (home / "command.txt").exists() else None
    return {"name": home.name, "command": command, "batches_per_epoch": batches, "curve": read_curve(run),
            "served": served}


def commit_draft(home: Path, step: int, dest: Path, *, target_name: str = "smollm2",
                 k_check: Path | None = None) -> Path:
    """The served checkpoint ``step`` of a run as a committed draft (peagle.cli.committed_drafts): its
    export without the target's embedding, and draft.json with what it measured and the commands.

    ``k_check``: benchmarks/k_check.sh's JSON for this checkpoint: the K eval recommended becomes the
    draft's serve_k (the demo serves it there), with what serving it at that K measured."""
    served = home / "served" / f"step-{step:08d}"
    report = json.loads((served / "report" / "report.json").read_text())
    checkpoint = home / "run" / "checkpoints" / f"step-{step:08d}"
    if not checkpoint.is_dir():
        raise SystemExit(f"{checkpoint} is gone (the run keeps its newest two): commit a checkpoint it still holds")
    # bf16 weights (vLLM serves in bf16 here anyway), in shards of 15 MiB: no file over 16 MiB, as git should
    # hold it (a 2-layer draft's trainable weights are 16.4 MiB in bf16)
    export = [*PEAGLE, "export", str(checkpoint), "--out", str(dest), "--without-target-embedding", "--dtype", "bfloat16",
              "--max-file-mib", "15", "--speculative-tokens", str(report["meta"]["num_depths"])]
    subprocess.run(export, check=True, stdout=subprocess.DEVNULL)
    work = home.parent.parent
    found = record(home, work)
    vllm = report["vllm"]
    facts = {"target": target_name, "method": "peagle" if vllm["parallel_drafting"] else "eagle3",
             "num_depths": report["meta"]["num_depths"], "acceptance_length": vllm["acceptance_length"],
             "per_depth_acceptance": vllm["per_depth_acceptance"], "speed": vllm.get("speed"),
             "vllm_dtype": vllm["settings"].get("dtype"),
             "trained": {"steps": step, "epochs": next((s["epochs"] for s in found["served"] if s["step"] == step), None),
                         "tokens": sum(describe_store(Path(p.split(":")[0]))["tokens"] or 0 for p in
                                       _store_flags(found["command"]))},
             "commands": ["python benchmarks/data_scaling.py --work WORK --stores-only",
                          with_placeholders(found["command"], work),
                          with_placeholders(shlex.join(["peagle", *export[3:]]).replace(str(dest), "DIR"), work)],
             "measured_by": f"peagle eval (vLLM {vllm['settings'].get('vllm_version')}, {vllm['settings'].get('dtype')}, "
                            "32 held-out prompts x 128 tokens)"}
    if k_check is not None:
        facts.update(serve_k_facts(json.loads(k_check.read_text())))
        engines = facts["at_serve_k"]["vllm_engines"]
        facts["commands"].append(with_placeholders(f"bash benchmarks/k_check.sh {checkpoint} EXPORT_K5 HELDOUT_PROMPTS "
                                                   f"WORK {k_check}" + (f" {engines}" if engines else ""), work))
    atomic_write_json(dest / "draft.json", facts)
    return dest


def with_placeholders(command: str, work: Path) -> str:
    """One machine's paths in a committed command as the names a reader fills in: WORK for
    data_scaling.py's work dir, TARGET for the ``--target`` the command names (a committed draft travels,
    its commands must not name the machine that trained it)."""
    words = shlex.split(command)
    target = next((words[i + 1] for i, word in enumerate(words[:-1]) if word == "--target"), None)
    if target:
        command = command.replace(target, "TARGET")
    return command.replace(str(work.resolve()), "WORK").replace(str(work), "WORK")


def serve_k_facts(check: dict) -> dict:
    """draft.json's serve_k and what serving there measured, from a k_check.sh summary; refused when
    the recommended K was not served (the check was cut short)."""
    best = check["recommendation"]["best_k"]
    served = check["served"].get(str(best))  # JSON's keys are strings
    if served is None:
        raise SystemExit(f"the K check recommends K = {best} but did not serve it: run k_check.sh to its end")
    # eager or compiled engines; None for a check made before k_check.sh recorded them (eager, unrecorded)
    engines = {True: "eager", False: "compiled"}.get(served.get("enforce_eager"))
    repeats = {key: served[key] for key in ("speedup_c1_runs", "speedup_c1_median") if key in served}
    return {"serve_k": best, "at_serve_k": {"acceptance_length": served["acceptance_length"], "speed": served["speed"],
                                            "vllm_engines": engines, **repeats},
            "k_check": check["predicted_vs_measured_c1"]}


def plot(runs: list[dict], out: Path) -> None:
    """:func:`figure_of` ``runs`` as a PNG at ``out`` (written whole or not at all)."""
    png = io.BytesIO()
    figure_of(runs).savefig(png, dpi=110, format="png")
    atomic_write_bytes(out, png.getvalue())


def figure_of(runs: list[dict]):
    """The curves of every run against its epochs: the trainer's held-out estimate (line) and the AL
    vLLM measured at each served checkpoint (dots, labelled with the speedup one request at a time)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    axes = figure.subplots()
    for i, run in enumerate(runs):  # every run its own colour (a fixed list of four once dropped the fifth)
        color = f"C{i % 10}"
        per_epoch = run["batches_per_epoch"] or 1
        curve = run["curve"]
        axes.plot([c["step"] / per_epoch for c in curve], [c["al_estimate"] for c in curve], color=color, alpha=0.45,
                  label=f"{run['name']}: held-out estimate (teacher-forced)")
        served = [s for s in run["served"] if s.get("acceptance_length")]
        axes.plot([s["step"] / per_epoch for s in served], [s["acceptance_length"] for s in served], "o-", color=color,
                  label=f"{run['name']}: AL in vLLM")
        for s in served:
            speedup = ((s.get("speed") or {}).get("concurrency_1") or {}).get("speedup")
            if speedup:
                axes.annotate(f"{speedup:.2f}x", (s["step"] / per_epoch, s["acceptance_length"]),
                              textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8, color=color)
    axes.set_xlabel("epochs of the run's data")
    axes.set_ylabel("acceptance length (K = 5)")
    axes.set_title("Convergence on 2 CPU cores (labels: speedup in vLLM, one request at a time)", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the curves, never on them
    figure.tight_layout()
    return figure


def _store_flags(command: str | None) -> list[str]:
    words = shlex.split(command or "")
    return [words[i + 1] for i, w in enumerate(words) if w == "--store"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="data_scaling.py's work dir (stores, data)")
    parser.add_argument("--name", help="the run (WORK/convergence/NAME)")
    parser.add_argument("--method", default="peagle", choices=("peagle", "eagle3"))
    parser.add_argument("--points", default="double", help="data_scaling.py's points whose parts train (comma list)")
    parser.add_argument("--steps", type=int, default=13500)
    parser.add_argument("--serve-every", type=int, default=1350, help="steps between checkpoints served in vLLM")
    parser.add_argument("--eval-dtype", default="bfloat16", help="vLLM's dtype serving each checkpoint (bfloat16: "
                        "the target's fastest setting on this project's CPUs, results/cpu/step_cost.json)")
    parser.add_argument("--extra", default="", help="more `peagle train` flags (e.g. '--num-layers 2')")
    parser.add_argument("--report-only", action="store_true", help="write the JSON from what the runs hold")
    parser.add_argument("--commit", metavar="NAME:STEP", help="write run NAME's served checkpoint STEP as a committed "
                        "draft under --drafts (its export without the target's embedding + draft.json), then exit")
    parser.add_argument("--k-check", type=Path, help="with --commit: k_check.sh's JSON for that checkpoint (the "
                        "draft is served at the K it recommends)")
    parser.add_argument("--drafts", type=Path, default=Path("benchmarks/results/cpu/drafts"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/convergence.json"))
    args = parser.parse_args(argv)
    from peagle.model.target.packaged import fetch_target

    if args.commit:
        name, step = args.commit.rsplit(":", 1)
        dest = commit_draft(args.work / "convergence" / name, int(step), args.drafts / f"{name}-step{int(step)}",
                            k_check=args.k_check)
        print(f"committed {dest}", flush=True)
        return
    if not args.report_only:
        if not args.name:
            raise SystemExit("--name NAME: the run to train (or --report-only)")
        run_one(args, fetch_target("smollm2"))
    homes = sorted(p for p in (args.work / "convergence").glob("*") if (p / "command.txt").exists())
    stores = {p.name: describe_store(p) for p in sorted((args.work / "stores").glob("*"))}
    runs = [record(h, args.work) for h in homes]
    atomic_write_json(args.out, {"stores": stores, "runs": runs})
    plot(runs, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", flush=True)


if __name__ == "__main__":
    main()
