"""``peagle demo``: the whole pipeline on an embedded default, one command, minutes on 2 CPU cores.

It runs the same commands a user would (each printed before it runs, each in its own process, so
a vLLM engine never outlives its stage): a demo target trained on stdlib documentation (cached),
chat data made from it, extract (vLLM if installed, else HF; with ``--regenerate`` so the draft
learns the target's own answers), vocab, train, export and eval. The demo is orchestration of
the stages, which is why it lives at the CLI layer: stages never import each other.
"""

from __future__ import annotations

import enum
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from peagle.cli import VERBOSE_KEY, app
from peagle.cli.config_command import PeagleCommand, check_out_is_not_a_file, split_list
from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError
from peagle.schemas.eval_config import EVAL_MODES
from peagle.schemas.store import HIDDEN_DTYPES

DEFAULT_CACHE = Path(os.environ.get("PEAGLE_CACHE_DIR", Path.home() / ".cache" / "peagle"))


def _vllm_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return probe.returncode == 0


def write_demo_data(out_dir: Path, *, num_heldout: int, seed: int) -> tuple[Path, Path, int]:
    """Chats about stdlib objects: most for training, ``num_heldout`` held out as eval prompts.

    Held-out prompts are user turns only (the eval decodes the target's own continuation), so the
    acceptance we report is measured on questions the draft never saw during training.
    """
    from peagle.testing.demo_target import demo_chats

    chats = demo_chats(seed=seed)
    random.Random(seed).shuffle(chats)
    heldout, train = chats[:num_heldout], chats[num_heldout:]
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, prompts_path = out_dir / "train.jsonl", out_dir / "heldout_prompts.jsonl"
    train_path.write_text("".join(json.dumps(c) + "\n" for c in train))
    prompts_path.write_text("".join(json.dumps({"messages": c["messages"][:1]}) + "\n" for c in heldout))
    return train_path, prompts_path, len(train)


class Backend(str, enum.Enum):
    """Extract backend of the demo (a choice, so a typo is a usage error before anything runs)."""

    auto = "auto"
    vllm = "vllm"
    hf = "hf"


def _run_stage(args: list[str], name: str, *, verbose: bool = False) -> float:
    """Run ``peagle ARGS`` as a subprocess on this terminal (its progress bars show live), echoing
    the command first so a user can rerun any stage by hand; returns its wall time."""
    args = ["--verbose", *args] if verbose else args
    print(f"\n$ peagle {shlex.join(args)}", flush=True)
    start = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "peagle", *args]).returncode
    if rc != 0:
        raise UserError(f"demo stage `peagle {name}` failed with exit code {rc} (its output is above)")
    return time.monotonic() - start


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def check_demo_options(*, out: Path, hidden_dtype: str, eval_modes: str | None, counts: dict[str, int],
                       seed: int) -> tuple[str, str | None]:
    """Every option, before the demo starts (a typo must not wait for the pipeline to run): (the hidden
    dtype, the eval modes) as the stages take them.

    Raises:
        UserError: one line naming the option.
    """
    check_out_is_not_a_file(out)
    hidden_dtype = dtype_choice("hidden-dtype", hidden_dtype, HIDDEN_DTYPES)
    if eval_modes is not None:
        modes = split_list(eval_modes, str, "eval-modes")
        unknown = sorted(set(modes) - set(EVAL_MODES))
        if unknown or not modes:
            raise UserError(f"--eval-modes takes a comma list of {','.join(EVAL_MODES)}, got {eval_modes!r}")
        eval_modes = ",".join(modes)
    for flag, value in counts.items():
        if value < 1:
            raise UserError(f"--{flag} must be >= 1, got {value}")
    if seed < 0:
        raise UserError(f"--seed must be >= 0, got {seed}")
    return hidden_dtype, eval_modes


@app.command("demo", cls=PeagleCommand)
def demo(
    ctx: typer.Context,
    out: Path = typer.Option(Path("peagle-demo"), "--out", help="Directory for everything the demo writes "
                             "(data, store, run, export, report). Re-running reuses finished stages.", metavar="DIR"),
    cache_dir: Path = typer.Option(DEFAULT_CACHE, "--cache-dir", help="Where the trained demo target is "
                                   "cached (env PEAGLE_CACHE_DIR).", metavar="DIR"),
    backend: Backend = typer.Option(Backend.auto, "--backend", help="Extract backend: auto (vllm if it imports), "
                                    "vllm, hf.", metavar="auto|vllm|hf"),
    num_depths: int = typer.Option(5, "--num-depths", help="K: tokens the draft proposes per step.", metavar="N"),
    num_layers: int = typer.Option(1, "--num-layers", help="Draft decoder layers.", metavar="N"),
    train_steps: int = typer.Option(300, "--train-steps", help="Draft training steps.", metavar="N"),
    target_steps: int = typer.Option(200, "--target-steps", metavar="N",
                                     help="Training steps of the demo target (first run only; cached by its settings)."),
    num_heldout: int = typer.Option(16, "--num-heldout", help="Chats held out as eval prompts.", metavar="N"),
    seed: int = typer.Option(0, "--seed", help="Seed for data split, training and sampling.", metavar="N"),
    hidden_dtype: str = typer.Option("bf16", "--hidden-dtype", help="How the store keeps the aux hidden states: "
                                     "bf16, or fp8 (about half the disk; docs/fp8.md).", metavar="bf16|fp8"),
    eval_modes: Optional[str] = typer.Option(None, "--eval-modes", help="Comma list of offline,online,vllm "
                                             "(default: all that can run here).", metavar="offline,online,vllm"),
) -> None:
    """Run the whole pipeline on a tiny target trained on Python's own documentation.

    Builds (and caches) the demo target, makes chat data, runs extract -> vocab -> train -> export
    -> eval, prints a summary table (store size, train throughput, per-depth acceptance, acceptance
    length in our loop and in vLLM) and where the plots are. About 10 minutes on 2 CPU cores the
    first time (the target trains once), less afterwards.
    """
    from peagle.testing.demo_target import DemoTargetSpec, build_demo_target

    hidden_dtype, eval_modes = check_demo_options(
        out=out, hidden_dtype=hidden_dtype, eval_modes=eval_modes, seed=seed,
        counts={"num-depths": num_depths, "num-layers": num_layers, "train-steps": train_steps,
                "target-steps": target_steps, "num-heldout": num_heldout})
    started = time.monotonic()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    t0 = time.monotonic()
    target = build_demo_target(cache_dir, DemoTargetSpec(max_steps=target_steps),
                               log=lambda m: print(m, flush=True))
    timings["target"] = time.monotonic() - t0
    print(f"demo target: {target}", flush=True)

    train_data, prompts, num_train = write_demo_data(out / "data", num_heldout=num_heldout, seed=seed)
    verbose = bool(ctx.meta.get(VERBOSE_KEY))  # `peagle --verbose demo`: every stage is verbose too

    def stage(args: list[str], name: str) -> float:
        return _run_stage(args, name, verbose=verbose)

    backend_name = backend.value
    if backend_name == "auto":
        backend_name = "vllm" if _vllm_importable() else "hf"
    store, run, export, report = out / "store", out / "run", out / "export", out / "report"

    timings["extract"] = stage(
        ["extract", "--data", str(train_data), "--target", str(target), "--out", str(store),
         "--backend", backend_name, "--regenerate", "--temperature", "0.7", "--max-new-tokens", "160",
         "--max-seq-len", "512", "--samples-per-shard", "256", "--seed", str(seed), "--hidden-dtype", hidden_dtype],
        "extract")
    timings["vocab"] = stage(["vocab", "--store", str(store), "--draft-vocab-size", "512", "--quiet"], "vocab")
    timings["train"] = stage(
        ["train", "--store", str(store), "--target", str(target), "--out", str(run),
         "--num-layers", str(num_layers), "--num-depths", str(num_depths), "--draft-vocab-size", "512",
         "--max-steps", str(train_steps), "--lr", "3e-3", "--warmup-steps", "30", "--token-budget", "2048",
         "--seed", str(seed), "--heldout-fraction", "0.02"], "train")
    timings["export"] = stage(["export", str(run), "--out", str(export)], "export")
    eval_args = ["eval", str(export), "--target", str(target), "--store", str(store), "--prompts", str(prompts),
                 "--out", str(report), "--max-prompts", str(num_heldout), "--max-new-tokens", "96",
                 "--num-depths", str(num_depths), "--quiet"]
    if eval_modes:
        eval_args += ["--mode", eval_modes]
    timings["eval"] = stage(eval_args, "eval")

    summary = summarize(store, run, report, timings, time.monotonic() - started, backend=backend_name,
                        num_train=num_train)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)


def summarize(store: Path, run: Path, report: Path, timings: dict[str, float], wall: float, *,
              backend: str, num_train: int) -> dict:
    manifest = _read_json(store / "manifest.json")
    store_bytes = sum(p.stat().st_size for p in (store / "shards").glob("*") if p.is_file())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "metrics.jsonl").exists() else []
    train_rows = [m for m in metrics if "tokens_per_s" in m]
    rep = _read_json(report / "report.json")
    return {
        "backend": backend,
        "train_chats": num_train,
        "store": {"samples": manifest.get("num_samples"), "tokens": manifest.get("num_tokens"),
                  "bytes": store_bytes},
        "train": {"steps": metrics[-1].get("step") if metrics else None,
                  "final_loss": metrics[-1].get("loss") if metrics else None,
                  "tokens_per_s": (sum(m["tokens_per_s"] for m in train_rows[-10:]) / len(train_rows[-10:]))
                  if train_rows else None},
        "eval": rep,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "wall_s": round(wall, 1),
        "report_dir": str(report),
    }


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_summary(summary: dict) -> None:
    """A table a person reads at a glance: store, training, acceptance in each mode, times."""
    rep = summary["eval"]
    store, train = summary["store"], summary["train"]
    lines = [
        "",
        "=" * 72,
        "peagle demo summary",
        "=" * 72,
        f"store        {store['samples']} samples, {store['tokens']} tokens, "
        f"{store['bytes'] / 2**20:.1f} MiB ({summary['backend']} backend)",
        f"train        {train['steps']} steps, final loss {_fmt(train['final_loss'], '.3f')}, "
        f"{_fmt(train['tokens_per_s'], '.0f')} tokens/s",
    ]
    for mode in ("offline", "online", "vllm"):
        section = rep.get(mode) or {}
        if not section or section.get("skipped"):
            reason = section.get("skipped") if section else "not run"
            lines.append(f"{mode:<12} skipped: {reason}")
            continue
        per_depth = section.get("per_depth_acceptance") or []
        al = section.get("acceptance_length")
        lines.append(f"{mode:<12} acceptance length {_fmt(al)}   per-depth acceptance "
                     + " ".join("-" if a is None else f"{a:.2f}" for a in per_depth))
        calm = section.get("non_repetitive") or {}
        if calm:
            lines.append(f"{'':<12} on {calm.get('num_prompts')} prompts with non-repetitive continuations: "
                         f"acceptance length {_fmt(calm.get('acceptance_length'))}")
        if section.get("speedup") is not None:
            lines.append(f"{'':<12} wall-clock speedup over plain decoding {_fmt(section.get('speedup'))}x "
                         "(tiny target on CPU: the draft costs as much as the target)")
    times = ", ".join(f"{k} {v:.0f}s" for k, v in summary["timings_s"].items())
    lines += [f"time         {summary['wall_s']:.0f} s total ({times})",
              f"report       {summary['report_dir']}/report.json and its PNG plots", "=" * 72]
    print("\n".join(lines), flush=True)
