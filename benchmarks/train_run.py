"""A real `peagle train` run on a synthetic store: first-step time, recompiles, data-wait share.

    python benchmarks/train_run.py --work /tmp/peagle-train-run --out train_run.json            # 8B shapes
    python benchmarks/train_run.py --tiny --steps 12 --work /tmp/w --out train_run.json        # CPU check

Writes (reused when present) a store of samples of *varying* lengths through the real store writer
(loader_throughput.build_store, its shards generated in parallel processes: 8B shapes, hidden 4096,
3 aux layers, top-32, 24,768 bytes/token; 28 samples of 256..3072 tokens, about 1 GB, built in
seconds: first step, recompiles and data wait need varying lengths, not many tokens), a target
directory with the 8B config and bf16 ``embed_tokens``/``lm_head`` (all a draft reads from its
target; the store records its content hash), and the draft vocab (`peagle vocab`'s function). Then
it runs the real CLI, ``python -m peagle train`` with DataLoader workers, ``--log-every 1``, for
``--steps`` steps over several epochs (every epoch reshuffles and redraws COD, so no two steps see one
batch), prints the CLI's output and one line per step as the run goes, and reads the run's own
metrics.jsonl:

* ``first_step_s``: step 1's time (compile included) minus its data wait (the workers' start-up);
  ``first_step_wall_s`` with it; ``startup_s`` from launch to step 1's start (imports, target,
  draft, loader);
* ``recompiles_after_warmup``: graphs torch.compile built after the warm-up steps (``--warmup``,
  default 2: the first graph and at most one re-trace that marks sizes dynamic), from the
  ``graphs_compiled`` metric the trainer logs per step;
* ``data_wait_share``: time the loop waited for the loader over the wall time of the steps after
  warm-up; ``tokens_per_s`` their median; ``process_s`` the whole command.

``--out`` is rewritten after every step, so a run killed by the suite's time limit (SIGTERM: the
CLI is stopped, ``killed`` is set) still reports the step records it got.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from loader_throughput import AUX_LAYERS, build_store, settings_for

SHAPES = {  # 8B (Llama-3.1-8B-shaped draft, as the reference harness) and toy (CPU smoke run)
    "8b": dict(hidden=4096, heads=32, kv=8, inter=14336, vocab=128256, draft_vocab=32000, topk=32,
               token_budget=4096, lengths=(256, 3072), num_samples=28, samples_per_shard=2),
    "tiny": dict(hidden=64, heads=4, kv=2, inter=128, vocab=1000, draft_vocab=300, topk=8,
                 token_budget=512, lengths=(16, 400), num_samples=48, samples_per_shard=8),
}


def build_target(out: Path, d: dict) -> Path:
    """config.json of an 8B-shaped Llama (or the toy one) + bf16 embed_tokens and lm_head: 4,096 random
    rows tiled over the vocab (a 2 GB target in a second; what is timed does not read their values)."""
    if (out / "config.json").exists():
        return out
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    LlamaConfig(hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=32,
                num_attention_heads=d["heads"], num_key_value_heads=d["kv"], head_dim=d["hidden"] // d["heads"],
                vocab_size=d["vocab"], max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = (torch.randn(min(4096, d["vocab"]), d["hidden"], generator=g) * 0.02).to(torch.bfloat16)
        weights[name] = rows.repeat(-(-d["vocab"] // rows.shape[0]), 1)[:d["vocab"]].contiguous()
    save_file(weights, str(tmp / "model.safetensors"))
    tmp.rename(out)
    return out


def prepare(work: Path, shape: str, seed: int, workers: int) -> tuple[Path, Path, dict]:
    """Target, store of varying sample lengths, and draft vocab under ``work`` (reused when present)."""
    from peagle.model.target.directory import content_hash as target_content_hash
    from peagle.stages.train.vocab import build_draft_vocab

    d = SHAPES[shape]
    target = build_target(work / f"target-{shape}", d)
    rng = random.Random(seed)
    lo, hi = d["lengths"]
    sizes = [rng.randint(lo, hi) for _ in range(d["num_samples"])]
    store = work / f"store-{shape}"
    settings = settings_for(max(sizes), hidden=d["hidden"], vocab=d["vocab"], topk=d["topk"],
                            content_hash=target_content_hash(target))
    build_store(store, d["token_budget"], len(sizes), samples_per_shard=d["samples_per_shard"], sample_tokens=sizes,
                settings=settings, workers=workers)
    build_draft_vocab(store, d["draft_vocab"])
    return target, store, {"num_samples": len(sizes), "tokens": sum(sizes), "min_sample_tokens": min(sizes),
                           "max_sample_tokens": max(sizes), "distinct_lengths": len(set(sizes))}


def summarise_metrics(records: list[dict], warmup: int) -> dict:
    """The figures of whatever step records there are (a killed run has fewer)."""
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    if not train:
        return {"steps": 0}
    steady = [r for r in train if r["step"] > warmup]
    first = train[0]
    wall = sum(r["step_time_s"] for r in steady)
    return {
        "steps": len(train),
        "first_step_wall_s": round(first["step_time_s"], 3),
        "first_step_s": round(first["step_time_s"] * (1 - first["data_wait_share"]), 3),
        "graphs_compiled_per_step": [r.get("graphs_compiled") for r in train],
        "recompiles_after_warmup": sum(r.get("graphs_compiled") or 0 for r in steady) if steady else None,
        "data_wait_share": round(sum(r["data_wait_share"] * r["step_time_s"] for r in steady) / max(wall, 1e-9), 5)
        if steady else None,
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady), 1) if steady else None,
        "step_s_median": round(statistics.median(r["step_time_s"] for r in steady), 4) if steady else None,
        "loss_first_last": [round(train[0]["loss"], 4), round(train[-1]["loss"], 4)],
    }


class Run:
    """The CLI as a child process: its output echoed line by line, its metrics.jsonl followed."""

    def __init__(self, cmd: list[str], metrics: Path):
        self.metrics, self.records, self.lines = metrics, [], []
        self.start = time.perf_counter()
        self.first_record_s: float | None = None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.reader = threading.Thread(target=self._echo, daemon=True)
        self.reader.start()

    def _echo(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            print(f"  | {line.rstrip()}", flush=True)

    def poll_metrics(self) -> list[dict]:
        """New metrics records since the last call (each printed as one line)."""
        if not self.metrics.exists():
            return []
        lines = self.metrics.read_text().splitlines()
        complete = lines if self.metrics.read_text().endswith("\n") else lines[:-1]
        new = [json.loads(line) for line in complete[len(self.records):]]
        for r in new:
            if r.get("kind") == "train":
                if self.first_record_s is None:
                    self.first_record_s = time.perf_counter() - self.start
                print(f"step {r['step']}: {r['step_time_s']:.3f} s, loss {r['loss']:.4f}, data wait "
                      f"{r['data_wait_share']:.1%}, {r['tokens_per_s']:.0f} tok/s, graphs compiled "
                      f"{r.get('graphs_compiled')}", flush=True)
        self.records.extend(new)
        return new

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def write(out: Path | None, result: dict) -> None:
    text = json.dumps(result, indent=1)
    if out:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke run)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/peagle-train-run"), help="store, target, run (reused)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the steady-state figures")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--workers", type=int, default=min(6, max(1, (os.cpu_count() or 2) - 4)))
    ap.add_argument("--build-workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes writing the synthetic store's shards")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the JSON here (rewritten after every step)")
    args = ap.parse_args()
    shape = "tiny" if args.tiny else "8b"
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target, store, store_facts = prepare(args.work, shape, args.seed, args.build_workers)
    d = SHAPES[shape]
    result = {"benchmark": "train_run", "shape": shape, "layers": args.layers, "workers": args.workers,
              "token_budget": d["token_budget"], "aux_layers": len(AUX_LAYERS),
              "prepare_s": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
              "device": "cuda" if torch.cuda.is_available() else "cpu", **store_facts}
    print(f"store and target ready in {result['prepare_s']} s ({store_facts['tokens']} tokens)", flush=True)
    run_dir = args.work / f"run-{shape}-{int(time.time())}"
    cmd = [sys.executable, "-m", "peagle", "train", "--store", str(store), "--target", str(target), "--out",
           str(run_dir), "--num-layers", str(args.layers), "--max-steps", str(args.steps), "--token-budget",
           str(d["token_budget"]), "--draft-vocab-size", str(d["draft_vocab"]), "--num-workers", str(args.workers),
           "--log-every", "1", "--eval-every", "0", "--save-every", "0", "--keep-checkpoints", "1",
           "--heldout-fraction", "0", "--warmup-steps", "5", "--lr", "1e-4", "--seed", str(args.seed)]
    run = Run(cmd, run_dir / "metrics.jsonl")
    stopping = {"signal": None}

    def on_term(signum, frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_term)
    while run.proc.poll() is None and stopping["signal"] is None:
        if run.poll_metrics():
            write(args.out, {**result, **summarise_metrics(run.records, args.warmup), "returncode": None})
        time.sleep(0.2)
    if stopping["signal"] is not None:
        run.stop()
    run.reader.join(timeout=5)
    run.poll_metrics()
    result.update(process_s=round(time.perf_counter() - run.start, 1), returncode=run.proc.returncode,
                  killed=stopping["signal"] is not None, **summarise_metrics(run.records, args.warmup))
    if run.first_record_s is not None and result.get("first_step_wall_s") is not None:
        result["startup_s"] = round(run.first_record_s - result["first_step_wall_s"], 1)
    if run.proc.returncode != 0:
        result["output_tail"] = "\n".join(run.lines[-20:])[-2000:]
    write(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "output_tail"}))
    sys.exit(124 if result["killed"] else (0 if run.proc.returncode == 0 else 1))


if __name__ == "__main__":
    main()
