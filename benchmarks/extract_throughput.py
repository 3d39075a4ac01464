"""Extraction throughput: `peagle extract` (hf backend) vs a bare prefill of the same model on the
same data, and the store's bytes/token vs the raw tensor bytes.

    python benchmarks/extract_throughput.py                       # CPU, tiny target, small data
    python benchmarks/extract_throughput.py --shape 8b --device cuda --records 512 --out bench.json
    python benchmarks/extract_throughput.py --target /models/Llama-3.1-8B-Instruct --device cuda

* ``extract_tokens_per_s``: tokens of the committed store / the driver's work time (first shard to
  last commit: templating, forward with aux capture, chunked full-vocab top-k, device->host copy,
  Parquet + safetensors writing with sha256, commit records), measured by ``run_extract`` itself;
  the model load and the plan are excluded, as for the prefill.
* ``prefill_tokens_per_s``: the same samples (read back from the store), the same fixed batches
  (``make_batches``), the model body's forward only (no lm_head, no top-k, no copy, no write).
  Of it, ``extract_forward_seconds`` ran the target (outputs on the host) and
  ``extract_writer_wait_seconds`` waited for the shard writer (a full queue, then the last shards'
  writes, which nothing overlaps: with few shards they weigh).
* ``ratio`` = extract / prefill (goal >= 0.9); ``bytes_per_token`` on disk vs
  ``raw_bytes_per_token`` = A*H*2 + k*(4 + logprob bytes) (goal <= 1.02x).

``--shape`` builds a random-weight target locally (``tiny``: the test target; ``8b``: Llama-3-8B
shapes with a 128,256 vocab and the tiny tokenizer, whose ids all fall in that vocab). Extract and
prefill runs alternate, and each figure is the best of ``--repeats`` runs; CUDA is synchronised
before every clock read. JSON on stdout (and in ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.store import open_store
from peagle.schemas.extract_config import ExtractConfig
from peagle.model.target.directory import load_causal_lm
from peagle.model.target.hf_backend import resolve_device, resolve_dtype
from peagle.stages.store.info import store_info
from peagle.stages.extract.run import make_batches, run_extract
from peagle.testing.chat_data import write_chat_jsonl
from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                tie_word_embeddings=False)


def build_8b_target(out: Path, device: torch.device) -> Path:
    """A Llama-3-8B-shaped target with random bf16 weights (initialised on ``device``, saved once)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, LlamaConfig

    from peagle.model.target.directory import load_tokenizer

    tiny = build_tiny_target(out.parent / "tiny-tokenizer", TinyTargetSpec(arch="llama"))
    tokenizer = load_tokenizer(tiny)
    config = LlamaConfig(**LLAMA_8B, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    del model
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class BarePrefill:
    """The model body's forward over a store's samples, in the driver's batches (the baseline)."""

    def __init__(self, target: Path, *, dtype: str, device: str) -> None:
        self.device = resolve_device(device)
        self.model = load_causal_lm(target, resolve_dtype(dtype, self.device), self.device)

    def batches(self, store_dir: Path, batch_size: int, max_batch_tokens: int) -> tuple[list[torch.Tensor], int]:
        store = open_store(store_dir)
        batches_BL = []
        for record in store.shards:
            ids = read_shard_rows(store, record.index, columns=["input_ids"]).column("input_ids").to_pylist()
            for batch in make_batches([len(x) for x in ids], batch_size, max_batch_tokens):
                t = torch.zeros((len(batch), len(ids[batch[0]])), dtype=torch.long)
                for b, i in enumerate(batch):
                    t[b, :len(ids[i])] = torch.as_tensor(ids[i])
                batches_BL.append(t)
        return batches_BL, store.num_tokens

    @torch.inference_mode()
    def seconds(self, batches_BL: list[torch.Tensor]) -> float:
        body = self.model.get_decoder()
        body(input_ids=batches_BL[0].to(self.device), use_cache=False)  # warm-up (kernels, allocator)
        sync(self.device)
        start = time.perf_counter()
        for input_ids_BL in batches_BL:
            body(input_ids=input_ids_BL.to(self.device, non_blocking=True), use_cache=False)
        sync(self.device)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, help="a local HF model dir (default: build one, see --shape)")
    ap.add_argument("--shape", choices=("tiny", "8b"), default="tiny")
    ap.add_argument("--records", type=int, default=96)
    ap.add_argument("--max-words", type=int, default=60, help="longest message of the synthetic chats, in words")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-batch-tokens", type=int, default=16384)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--samples-per-shard", type=int, default=32)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--workdir", type=Path, help="where targets, data and stores go (default: a temp dir)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="peagle-extract-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    if args.target is not None:
        target = args.target
    elif args.shape == "8b":
        target = build_8b_target(work / "llama-8b-random", dev)
    else:
        target = build_tiny_target(work / "tiny-llama", TinyTargetSpec(arch="llama"))
    data = write_chat_jsonl(work / "chats.jsonl", args.records, seed=0, min_words=args.max_words // 3,
                            max_words=args.max_words)

    # Extract and prefill alternate, best of each: drift in the machine's load hits both alike.
    bare = BarePrefill(target, dtype=args.dtype, device=args.device)
    best_extract = best_prefill = float("inf")
    for r in range(args.repeats):
        out = work / f"store-{r}"
        shutil.rmtree(out, ignore_errors=True)
        config = ExtractConfig(data=(str(data),), target=str(target), out=str(out), backend="hf",
                               device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                               max_batch_tokens=args.max_batch_tokens, max_seq_len=args.max_seq_len,
                               samples_per_shard=args.samples_per_shard, topk=args.topk, threads=args.threads)
        summary = run_extract(config, echo=lambda line: print(line, file=sys.stderr), progress=False)
        if summary.work_seconds < best_extract:
            best_extract, split = summary.work_seconds, (summary.forward_seconds, summary.writer_wait_seconds)
        batches_BL, num_tokens = bare.batches(out, args.batch_size, args.max_batch_tokens)
        best_prefill = min(best_prefill, bare.seconds(batches_BL))
        info = store_info(out)
        assert num_tokens == info.num_tokens
        if r + 1 < args.repeats:
            shutil.rmtree(out, ignore_errors=True)
    prefill_s = best_prefill
    s = info.settings
    result = {
        "benchmark": "extract_throughput",
        "target": str(target) if args.target else f"random {args.shape}",
        "architecture": s.target.architecture, "num_hidden_layers": s.target.num_hidden_layers,
        "hidden_size": s.target.hidden_size, "vocab_size": s.target.vocab_size, "dtype": s.target.dtype,
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else
                              f" ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"),
        "aux_layer_ids": list(s.aux_layer_ids), "topk": s.topk, "logprob_dtype": s.logprob_dtype,
        "records": args.records, "samples": info.num_samples, "tokens": info.num_tokens,
        "mean_tokens_per_sample": round(info.num_tokens / max(info.num_samples, 1), 1),
        "batch_size": args.batch_size, "max_batch_tokens": args.max_batch_tokens, "repeats": args.repeats,
        "extract_seconds": round(best_extract, 4), "prefill_seconds": round(prefill_s, 4),
        "extract_forward_seconds": round(split[0], 4), "extract_writer_wait_seconds": round(split[1], 4),
        "extract_tokens_per_s": round(info.num_tokens / best_extract, 1),
        "prefill_tokens_per_s": round(info.num_tokens / prefill_s, 1),
        "ratio_extract_over_prefill": round(prefill_s / best_extract, 4),
        "bytes_per_token": round(info.bytes_per_token, 2), "raw_bytes_per_token": info.raw_bytes_per_token,
        "bytes_ratio": round(info.bytes_per_token / info.raw_bytes_per_token, 5),
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
