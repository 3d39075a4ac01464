"""Shard writer throughput alone (no model): can `peagle extract`'s writer keep pace with an 8B prefill?

    python benchmarks/writer_throughput.py --compare 53da0c3 --json benchmarks/results/cpu/writer_throughput.json
    python benchmarks/writer_throughput.py --threads 1 2 4 --hidden-dtype bf16 fp8 --shards 8

An 8B target in bf16 prefills ~32k tokens/s on an H200 (benchmarks/results/gpu/2026-11-27-h200-b/):
~0.8 GB/s of aux states (A = 3 aux layers x H = 4096 x 2 bytes = 24 KiB a token) that the writer must
check, encode, hash and write. This script feeds the real ``ShardWriter`` (the one ``run_extract``
drives) synthetic shards shaped like that target's output -- A = 3, H = 4096, top-32 float32
log-probs in, float16 stored; samples of ``--min-tokens`` .. ``--max-tokens`` tokens, ``--samples-per-shard``
a shard, bf16 states as the HF backend hands them over -- and times it end to end, from the first
``submit`` to ``close``: encoding (fp8: quantisation), the content statistics and NaN checks, the
Parquet and safetensors writes, sha256 + crc32 of both files, fsync, rename, commit record and manifest.

Per (encoding, writer threads): ``aux_mb_per_s`` -- MB (1e6 bytes) of the target's aux states (bf16,
whatever the encoding stores) per wall second, the figure to hold against a prefill's ~800;
``tokens_per_s``; ``file_mb_per_s`` (bytes on disk); ``cpu_seconds_per_gb`` (process CPU time per GB
of aux states: what the writer costs a machine with more cores). ``--threads`` is ``ShardWriter``'s
``num_threads`` (shards written at once; extract uses ``WRITER_THREADS``); every configuration writes
the same ``--shards`` shards into a fresh store, deleted after.

``--compare REV`` also measures the writer as of git revision REV (its ``peagle`` package, exported
with ``git archive`` into a temp dir), in turns with this tree's: each round runs both, in
alternating order, each in its own process, and ``speedup`` compares the medians of ``--rounds``
rounds. JSON on stdout (and in ``--json``), with the machine (cpu count, load average before and
after): on a shared machine, compare only figures from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, AUX_LAYERS, TOPK, TARGET_VOCAB = 4096, (2, 16, 29), 32, 128256
MB = 1e6


def settings_for(hidden_dtype: str, *, hidden: int = HIDDEN, max_seq_len: int = 2048):
    from peagle.schemas import store as S

    return S.StoreSettings(
        target=S.TargetIdentity(path="synthetic-8b", architecture="LlamaForCausalLM", num_hidden_layers=32,
                                hidden_size=hidden, vocab_size=TARGET_VOCAB, dtype="bfloat16",
                                content_hash="synthetic"),
        tokenizer_fingerprint="synthetic", chat_template_hash="synthetic", aux_layer_ids=AUX_LAYERS, topk=TOPK,
        max_seq_len=max_seq_len, logprob_dtype="float16", loss_on="all", mask_token_id=TARGET_VOCAB - 1,
        hidden_dtype=hidden_dtype)


def synthetic_shards(num_shards: int, samples_per_shard: int, min_tokens: int, max_tokens: int, *,
                     hidden: int = HIDDEN, seed: int = 0) -> list:
    """``num_shards`` ShardContents of random 8B-shaped target outputs (one set of samples, shared by
    every shard: the writer reads them only, and memory stays at one shard's worth)."""
    import torch

    from peagle.model.target.backend import TargetOutput
    from peagle.stages.extract.template import TokenizedSample
    from peagle.stages.extract.writer import ShardContent

    gen = torch.Generator().manual_seed(seed)
    samples, outputs = [], []
    for i in range(samples_per_shard):
        n = int(torch.randint(min_tokens, max_tokens + 1, (1,), generator=gen))
        ids = torch.randint(0, TARGET_VOCAB - 1, (n,), generator=gen, dtype=torch.int32)
        samples.append(TokenizedSample(sample_id=f"{seed}-{i}", source=f"synthetic:{i}", input_ids=ids.tolist(),
                                       loss_mask=[0] * min(n, 16) + [1] * max(n - 16, 0)))
        # Top-k ids: the next token first most of the time (real agreement statistics); log-probs descending.
        topk_ids = torch.randint(0, TARGET_VOCAB - 1, (n, TOPK), generator=gen, dtype=torch.int32)
        topk_ids[:-1, 0] = ids[1:]
        logprobs = (torch.randn(n, TOPK, generator=gen) * 2).log_softmax(-1).sort(dim=-1, descending=True).values
        # States as a target's: mostly O(1), a few channels hundreds of times larger, bf16 on the host.
        aux = torch.randn(n, len(AUX_LAYERS), hidden, generator=gen)
        aux[..., :4] *= 300
        outputs.append(TargetOutput(aux_TAH=aux.to(torch.bfloat16), topk_ids_TK=topk_ids, topk_logprobs_TK=logprobs))
    return [ShardContent(index=s, input_name="synthetic.jsonl", first_record=s * samples_per_shard,
                         end_record=(s + 1) * samples_per_shard, samples=samples, outputs=outputs, backend="hf")
            for s in range(num_shards)]


def measure(workdir: Path, hidden_dtype: str, num_threads: int, shards: list) -> dict:
    """Write ``shards`` through a ``ShardWriter`` with ``num_threads`` threads into a fresh store; the wall
    and CPU time from the first submit to close."""
    from peagle.pipeline.store import init_store
    from peagle.stages.extract.writer import ShardWriter

    settings = settings_for(hidden_dtype)
    root = Path(tempfile.mkdtemp(prefix=f"writer-{hidden_dtype}-{num_threads}-", dir=workdir))
    try:
        init_store(root, settings)
        cpu, wall = time.process_time(), time.perf_counter()
        writer = ShardWriter(root, settings, num_threads=num_threads)  # max_pending as extract runs it
        for content in shards:
            writer.submit(content)
        records = writer.close()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tokens = sum(r.num_tokens for r in records)
    aux_bytes = tokens * len(AUX_LAYERS) * HIDDEN * 2
    file_bytes = sum(r.parquet_bytes + r.safetensors_bytes for r in records)
    return {"hidden_dtype": hidden_dtype, "threads": num_threads, "shards": len(records), "tokens": tokens,
            "aux_mb": round(aux_bytes / MB, 1), "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3),
            "aux_mb_per_s": round(aux_bytes / MB / wall, 1), "tokens_per_s": round(tokens / wall, 1),
            "file_mb_per_s": round(file_bytes / MB / wall, 1),
            "cpu_seconds_per_gb": round(cpu / (aux_bytes / 1e9), 3)}


def run_configs(args) -> list[dict]:
    """Every (encoding, threads) configuration once, in this process (this tree's or ``PYTHONPATH``'s peagle)."""
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    shards = synthetic_shards(args.shards, args.samples_per_shard, args.min_tokens, args.max_tokens)
    args.workdir.mkdir(parents=True, exist_ok=True)
    measure(args.workdir, args.hidden_dtype[0], 1, shards[:1])  # warm-up: imports, first allocations
    return [measure(args.workdir, dtype, threads, shards) for dtype in args.hidden_dtype for threads in args.threads]


def _argv_of(args) -> list[str]:
    return ["--shards", str(args.shards), "--samples-per-shard", str(args.samples_per_shard),
            "--min-tokens", str(args.min_tokens), "--max-tokens", str(args.max_tokens),
            "--torch-threads", str(args.torch_threads), "--workdir", str(args.workdir),
            "--hidden-dtype", *args.hidden_dtype, "--threads", *map(str, args.threads)]


def run_in_process(args, pythonpath: str | None) -> list[dict]:
    """``run_configs`` in a fresh interpreter, with ``pythonpath`` (a baseline's peagle) first."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--configs-only", *_argv_of(args)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


def export_revision(rev: str, into: Path) -> str:
    """``peagle/`` as of ``rev`` under ``into``; returns the full commit hash."""
    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                            stdout=subprocess.PIPE, text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit, "peagle"], check=True,
                             stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def machine_info() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_average_at_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict | list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-dtype", nargs="+", default=["bf16", "fp8"], choices=("bf16", "fp8"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="ShardWriter threads")
    ap.add_argument("--shards", type=int, default=4, help="shards written per configuration")
    ap.add_argument("--samples-per-shard", type=int, default=4)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=1, help="with --compare: rounds of (baseline, this tree)")
    ap.add_argument("--compare", metavar="REV", help="also measure the writer of git revision REV, in turns")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "peagle-writer-bench",
                    help="where the stores are written (deleted after each configuration)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--configs-only", action="store_true", help=argparse.SUPPRESS)  # one side of --compare
    args = ap.parse_args(argv)
    if args.configs_only:
        configs = run_configs(args)
        print(json.dumps(configs))
        return configs

    result = {"benchmark": "writer_throughput", "machine": machine_info(), "command": " ".join(sys.argv),
              "shape": {"aux_layers": len(AUX_LAYERS), "hidden": HIDDEN, "topk": TOPK, "logprob_dtype": "float16",
                        "shards": args.shards, "samples_per_shard": args.samples_per_shard,
                        "tokens_per_sample": [args.min_tokens, args.max_tokens]}}
    started = time.perf_counter()
    if not args.compare:
        result["configs"] = run_configs(args)
    else:
        with tempfile.TemporaryDirectory(prefix="peagle-baseline-") as base:
            result["baseline_commit"] = export_revision(args.compare, Path(base))
            runs: dict[str, list[list[dict]]] = {"baseline": [], "current": []}
            for r in range(args.rounds):
                for side in (("baseline", "current") if r % 2 == 0 else ("current", "baseline")):
                    runs[side].append(run_in_process(args, base if side == "baseline" else None))
                    print(f"round {r} {side}: " + ", ".join(f"{c['hidden_dtype']}/{c['threads']}t "
                                                            f"{c['aux_mb_per_s']} MB/s" for c in runs[side][-1]),
                          file=sys.stderr, flush=True)
        result["configs"] = []
        for i, config in enumerate(runs["current"][0]):
            row = {"hidden_dtype": config["hidden_dtype"], "threads": config["threads"]}
            for side, rounds in runs.items():
                row[f"{side}_aux_mb_per_s"] = [rnd[i]["aux_mb_per_s"] for rnd in rounds]
                row[f"{side}_cpu_seconds_per_gb"] = [rnd[i]["cpu_seconds_per_gb"] for rnd in rounds]
            row["speedup"] = round(statistics.median(row["current_aux_mb_per_s"])
                                   / statistics.median(row["baseline_aux_mb_per_s"]), 2)
            result["configs"].append(row)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
