"""The real-scale run's pipeline (issue 36): prompts, answers, stores, drafts and exports, made by the
product's own commands inside one GPU window, against a deadline.

``benchmarks/gpu_real_scale.py`` starts this detached on the GPU machine (so it outlives the call
that started it) and packs what it wrote; ``--smoke`` runs the same steps at toy size on CPU. Every
step is a ``peagle`` command, printed as it runs, timed into ``summary.json``; a step that fails or
runs out of time is recorded with the reason and the steps that do not need it still run.

Data. Prompts are the target's own (``peagle prompts``, Magpie) beside the templated generator's
training prompts (their first turn: one answer each), deduplicated; held-out subjects are kept out
twice: ``--exclude-phrases`` (every held-out subject's phrases) and ``--exclude-prompts`` (the
held-out prompts), then :func:`leaks` checks the final training file again and the count goes into
the summary. The prompts are split 1/16, 3/16, 12/16 into three stores (``a0``, ``a1``, ``a2``)
answered greedily, so the data-scaling row trains on ``a0``, ``a0+a1`` and all three with equal
steps; a fourth store (``s2``: ``a2``'s prompts answered again at T = 0.7) is made only while the
generation budget lasts, and the headline runs mix it in.

Drafts. All runs train at once on the one GPU (a 135M target's drafts leave it mostly idle alone),
each with ``--max-steps`` from :func:`plan_steps` and checkpoints every ``save_every`` steps; at the
deadline a run still going is stopped and its newest checkpoint exported (the summary says so).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from recipe_curves import read_curve  # the trainer's held-out evaluations, one reader for both benchmarks

from peagle.pipeline.atomic import atomic_write_json
from peagle.demo.chat_prompts import chat_prompts, is_heldout, _subjects


@dataclass(frozen=True)
class Scale:
    """Sizes and budgets of one run. :data:`GPU` is the real one, :data:`SMOKE` the CPU test's."""

    device: str = "cuda"
    num_magpie: int = 24000
    num_templated: int | None = None
    """Templated training prompts used (None: all of them)."""
    prompt_chunks: int = 3
    """``peagle prompts`` runs (a slow target still leaves the chunks made in time)."""
    min_prompt_s: float = 60.0
    """The least time the first prompts run gets, whatever the window's share says."""
    prompt_batch: int = 2048
    prompt_max_new: int = 96
    answer_batch: int = 2048
    samples_per_shard: int = 2048
    max_new_tokens: int = 256
    max_seq_len: int = 1024
    max_batch_tokens: int = 131072
    hidden_dtype: str = "fp8"
    heldout_chats: int = 64
    serve_prompts: int = 32
    vocab: int = 2048
    token_budget: int = 16384
    num_workers: int = 3
    train_threads: int = 1
    """Torch threads of each training process (five share the machine's cores with their loaders)."""
    startup_s: float = 75.0
    """Seconds a training process spends before its first step (imports, stores, compile)."""
    steps_per_s: dict = field(default_factory=lambda: {"peagle-1l": 3.0, "peagle-4l": 2.0, "eagle3-1l": 1.5})
    """Guessed optimizer steps per second of each draft kind when all runs share the GPU and the
    machine's cores (the loader's COD and mask work was ~70 ms per 2k tokens per worker on 2 CPU
    cores, benchmarks/results/cpu/loader_throughput.json: at 16k tokens a step, three workers
    feed about 4 steps/s)."""
    min_steps: int = 100
    max_steps: int = 6000
    keep_checkpoints: int = 3
    """Checkpoints each run keeps: the smoke keeps one, as five runs of three 150-230 MB checkpoints
    filled a CI machine's disk (2.5 GB of a 3.5 GB test folder)."""
    export_files_mib: int = 15
    """Parts of the packed results are at most this size (a device call returns files of 16 MiB)."""
    sampled_store: bool = True
    """Whether ``s2`` is made (while the generation budget lasts)."""
    scaling_row: bool = True
    """Whether the scaling row's small points train beside the headline drafts."""


GPU = Scale()
SMOKE = Scale(device="cpu", num_magpie=4, num_templated=20, prompt_chunks=1, min_prompt_s=400.0, prompt_batch=4,
              prompt_max_new=32, answer_batch=16,
              samples_per_shard=16, max_new_tokens=16, max_seq_len=256, max_batch_tokens=4096, hidden_dtype="bf16",
              heldout_chats=4, serve_prompts=2, vocab=256, token_budget=512, num_workers=0, startup_s=5.0,
              steps_per_s={"peagle-1l": 1.0, "peagle-4l": 1.0, "eagle3-1l": 1.0}, min_steps=2, max_steps=2,
              keep_checkpoints=1, sampled_store=False, scaling_row=False)
"""The real target on 2 CPU cores, every step at toy size (tests/benchmarks/test_gpu_real_scale.py). It
makes no ``s2`` and trains the headline drafts only: ``s2`` is ``a2``'s extract again at another
temperature, the scaling row the same train command on fewer stores (the plan's unit test parses every
run's command), and leaving them out saves ~55 s of CI's 2 cores (2026-12-02)."""

PARTS = {"a0": 1, "a1": 3, "a2": 12}
"""Greedy stores and their share of the prompts (sixteenths)."""


@dataclass(frozen=True)
class Run:
    name: str
    kind: str
    """Key of Scale.steps_per_s."""
    stores: tuple[str, ...]
    flags: tuple[str, ...]
    headline: bool


RUNS = (  # in priority order: the headline drafts first, then the scaling row's small points
    Run("peagle-4l", "peagle-4l", ("a0", "a1", "a2", "s2"), ("--num-layers", "4"), True),
    Run("eagle3-1l", "eagle3-1l", ("a0", "a1", "a2", "s2"), ("--method", "eagle3", "--num-layers", "1"), True),
    Run("peagle-1l", "peagle-1l", ("a0", "a1", "a2"), ("--num-layers", "1"), True),
    Run("peagle-1l-quarter", "peagle-1l", ("a0", "a1"), ("--num-layers", "1"), False),
    Run("peagle-1l-sixteenth", "peagle-1l", ("a0",), ("--num-layers", "1"), False),
)
COMMON_TRAIN = ("--num-depths", "5", "--lr", "3e-3", "--seed", "0", "--no-train-embeddings")
"""The CPU recipes' rates (recipe_curves.BASE) and K = 5; the target's embedding frozen, so an export
travels back without it (peagle.model.speculators_format.without_target_embedding)."""


# --------------------------------------------------------------------------------------------------
# Prompts


def heldout_phrases() -> list[str]:
    """Every held-out subject's words (leading articles dropped), the ones a training prompt must not
    mention. Arithmetic subjects are numbers, which any prompt may contain: they are left out."""
    phrases = set()
    for kind, fields in _subjects():
        if kind == "math" or not is_heldout(kind, fields, 0.15):
            continue
        for key, value in fields.items():
            if key == "A":
                continue
            phrases.add(re.sub(r"^(a|an|the|my|our) ", "", str(value).strip(), flags=re.I))
    return sorted(p for p in phrases if len(p) >= 3)


def heldout_chats(num: int) -> list[dict]:
    """The held-out prompts (the CPU figures' 64 for the eval store; their first 32 are served)."""
    return [{"messages": p.messages()[:1]} for p in chat_prompts(split="heldout")][:num]


def templated_train_prompts(limit: int | None = None) -> list[dict]:
    """The templated generator's training prompts, first turn only: one answer each, one round of
    generation (a follow-up's longer prompts would be another cache shape for one shard)."""
    return [{"messages": p.messages()[:1]} for p in chat_prompts(split="train")][:limit]


def normalised(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def leaks(magpie: list[dict], templated: list[dict], phrases: list[str]) -> dict:
    """What of the training prompts touches the held-out split (the run refuses to train unless all
    are 0): prompts equal to a held-out prompt; templated prompts about a held-out subject (the
    generator splits by subject, so a training prompt may share a word with a held-out subject, not
    the subject); target-written prompts that mention any held-out subject's phrase."""
    heldout = chat_prompts(split="heldout")
    held_texts = {normalised(p.text) for p in heldout}
    held_subjects = {p.subject for p in heldout}
    train_subjects = {p.text: p.subject for p in chat_prompts(split="train")}
    pattern = re.compile(r"\b(" + "|".join(re.escape(p.lower()) for p in phrases) + r")\b") if phrases else None
    texts = [c["messages"][0]["content"] for c in magpie + templated]
    return {"equal_to_heldout_prompt": sum(normalised(t) in held_texts for t in texts),
            "templated_heldout_subject": sum(train_subjects.get(c["messages"][0]["content"]) in held_subjects
                                             for c in templated),
            "target_written_mention_heldout_phrase": sum(bool(pattern and pattern.search(c["messages"][0]["content"].lower()))
                                                         for c in magpie),
            "phrases": len(phrases), "heldout_prompts": len(held_texts)}


def distinct_first_turns(chats: list[dict]) -> list[dict]:
    """Each chat's first user turn alone, in order, dropping empty ones and repeats (compared
    :func:`normalised`): one answer per distinct prompt."""
    seen, out = set(), []
    for chat in chats:
        key = normalised(chat["messages"][0]["content"])
        if key and key not in seen:
            seen.add(key)
            out.append({"messages": [chat["messages"][0]]})
    return out


LEAK_COUNTS = ("equal_to_heldout_prompt", "templated_heldout_subject", "target_written_mention_heldout_phrase")
"""The counts of :func:`leaks` that must all be 0 for a run to train."""


def refuse_leaks(checked: dict) -> None:
    """Stop the run, in one line, when :func:`leaks` found any held-out prompt or subject."""
    if any(checked[k] for k in LEAK_COUNTS):
        raise SystemExit(f"held-out prompts or subjects leak into training: {checked}")


def split_prompts(chats: list[dict], work: Path, parts: dict[str, int] = PARTS) -> dict[str, Path]:
    """Training prompts in a fixed shuffled order (sha of the text), cut by ``parts``' shares (the
    a-stores' 1:3:12 by default) into WORK/data/prompts-NAME.jsonl."""
    import hashlib

    order = sorted(chats, key=lambda c: hashlib.sha256(c["messages"][0]["content"].encode()).hexdigest())
    total, paths, start = sum(parts.values()), {}, 0
    for i, (name, share) in enumerate(parts.items()):
        end = len(order) if i == len(parts) - 1 else start + len(order) * share // total
        paths[name] = write_jsonl(work / "data" / f"prompts-{name}.jsonl", order[start:end])
        start = end
    return paths


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------------
# Training plan


def plan_steps(scale: Scale, kind: str, seconds_left: float) -> int:
    """``--max-steps`` of a run of ``kind``, so it ends by the deadline at the guessed rate; every
    run of one kind gets the same (the scaling row's points train equal steps, as the issue asks)."""
    steps = int((seconds_left - scale.startup_s) * scale.steps_per_s[kind])
    return max(scale.min_steps, min(scale.max_steps, steps))


def train_args(run: Run, stores: dict[str, Path], weights: dict[str, float], *, target: Path, heldout: Path,
               out: Path, steps: int, scale: Scale) -> list[str]:
    """``peagle train`` arguments of one run: the stores it has (``s2`` only if it was made), weighted
    by their records so every training sample is about equally likely."""
    store_flags = []
    for name in run.stores:
        if name in stores:
            store_flags += ["--store", f"{stores[name]}:{weights[name]:g}"]
    every = max(1, steps // 6)
    flags = ["train", *store_flags, "--target", str(target), "--out", str(out), "--eval-store", str(heldout),
             "--draft-vocab-size", str(scale.vocab), "--token-budget", str(scale.token_budget),
             "--max-steps", str(steps), "--warmup-steps", str(max(1, steps // 20)), "--eval-every", str(every),
             "--save-every", str(every), "--keep-checkpoints", str(scale.keep_checkpoints),
             "--num-workers", str(scale.num_workers), *COMMON_TRAIN, *run.flags]
    if "s2" in stores and "s2" in run.stores:
        flags.append("--allow-incomplete")  # s2 is cut at the generation deadline
    return flags


def train_rate(run_dir: Path) -> dict:
    """Steps, steps/s and tokens/s of a run, from its metrics.jsonl training lines."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    train = [r for r in rows if r.get("kind") != "eval"]
    if not train:
        return {"steps": 0}
    last = train[-1]
    return {"steps": last.get("step"), "steps_per_s": last.get("steps_per_s"), "tokens_per_s": last.get("tokens_per_s"),
            "train_loss": last.get("loss")}


# --------------------------------------------------------------------------------------------------
# Running commands against the deadline


class Steps:
    """Runs and times the pipeline's commands; every record goes to ``summary.json`` at once."""

    def __init__(self, work: Path, deadline: float, *, env: dict[str, str]):
        self.work, self.deadline, self.env = work, deadline, env
        self.summary: dict = {"started": time.time(), "deadline": deadline, "steps": []}
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        atomic_write_json(self.work / "summary.json", self.summary)

    def peagle(self, name: str, args: list[str], *, budget: float | None = None) -> bool:
        """One ``peagle`` command, logged to logs/NAME.log, stopped (SIGINT, then SIGKILL) after
        ``budget`` seconds. True when it exited 0."""
        cmd = [sys.executable, "-m", "peagle", *args]
        print(f"[{time.strftime('%H:%M:%S')}] $ peagle {shlex.join(args)}", flush=True)
        started = time.time()
        with open(self.work / "logs" / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
            rc = wait_or_stop(proc, budget)
        record = {"step": name, "command": "peagle " + shlex.join(args), "rc": rc,
                  "seconds": round(time.time() - started, 1), "budget_s": None if budget is None else round(budget)}
        self.summary["steps"].append(record)
        self.save()
        tail = (self.work / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        print(f"    rc={rc} in {record['seconds']} s" + "".join(f"\n    | {t[:220]}" for t in tail), flush=True)
        return rc == 0


def wait_or_stop(proc: subprocess.Popen, budget: float | None) -> int:
    """Wait for ``proc``; past ``budget`` seconds stop its whole session (SIGINT, 20 s, SIGKILL)."""
    try:
        return proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return -1


def start_training(runs: list[Run], steps: Steps, args_of: dict[str, list[str]], *,
                   threads: int) -> dict[str, subprocess.Popen]:
    """Every run at once, each in its own session (stopped whole at the deadline)."""
    env = dict(steps.env, OMP_NUM_THREADS=str(threads))
    procs = {}
    for run in runs:
        print(f"[{time.strftime('%H:%M:%S')}] $ peagle {shlex.join(args_of[run.name])}  &", flush=True)
        log = open(steps.work / "logs" / f"train-{run.name}.log", "w")
        procs[run.name] = subprocess.Popen([sys.executable, "-m", "peagle", *args_of[run.name]], stdout=log,
                                           stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return procs


def extract_rates(log: Path) -> dict:
    """Generated tokens and seconds (the regeneration lines), and the extracted tokens and seconds
    (extract's closing lines), from one ``peagle extract --regenerate`` log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    rounds = re.findall(r"regenerated shard \d+, round \d+ of \d+: [\d,]+ answers, ([\d,]+) tokens in (\d+) s", text)
    generated = sum(int(t.replace(",", "")) for t, _ in rounds)
    generation_s = sum(int(sec) for _, sec in rounds)
    work = re.search(r"time\s+([\d.]+) s:", text)
    committed = re.search(r"committed \d+ shards, ([\d,]+) tokens", text)
    out = {"generated_tokens": generated, "generation_s": generation_s,
           "generated_tokens_per_s": round(generated / generation_s) if generation_s else None}
    if work and committed:
        tokens, seconds = int(committed.group(1).replace(",", "")), float(work.group(1))
        out.update(extracted_tokens=tokens, extract_s=seconds,
                   extracted_tokens_per_s=round(tokens / seconds) if seconds else None)
    return out


def summary_of_run(run: Run, run_dir: Path, rc: int | None, steps_planned: int) -> dict:
    curve = read_curve(run_dir)
    return {"run": run.name, "headline": run.headline, "stores": list(run.stores), "flags": list(run.flags),
            "rc": rc, "stopped_at_deadline": rc == -1, "steps_planned": steps_planned, **train_rate(run_dir),
            "curve": curve, "final_al_estimate": curve[-1]["al_estimate"] if curve else None}
