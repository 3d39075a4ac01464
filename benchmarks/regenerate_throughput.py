"""Regeneration throughput: new tokens per second of a backend's ``generate`` (what ``peagle extract
--regenerate`` spends its time on), by backend, generation dtype, batch size and KV cache, on the
real target and real chat prompts.

    python benchmarks/regenerate_throughput.py --target "$(peagle target fetch smollm2 | tail -1)" \\
        --configs float32:8 bfloat16:16 bfloat16:64 bfloat16:128 --out benchmarks/results/cpu/regenerate_throughput.json
    python benchmarks/regenerate_throughput.py --target ... --max-new-tokens 256 \\
        --configs bfloat16:64 vllm-float32:32 vllm-bfloat16:32 vllm-bfloat16:128 --out ...

A configuration is ``DTYPE:BATCH[:CACHE]`` for the hf backend (``HFBackend``, a bf16 copy of the
model for ``bfloat16``) and ``vllm-DTYPE:SEQS`` for the vllm backend's generating engine
(``VllmBackend``: every prompt handed over at once, at most SEQS running together, the engine start
not timed).

Each configuration answers the same prompts (the templated generator's first training prompts,
greedy, up to ``--max-new-tokens``) in batches of its size; configurations alternate over
``--repeats`` rounds and each figure is the best round (a shared machine's noise only slows; the
JSON keeps the load average at the end, so a loaded run is seen as one).
``new_tokens_per_s`` counts tokens up to each answer's end (what a store receives), not the padding
of rows that ended early. The first configuration is the old default (float32, batch 8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle.model.target.directory import open_target  # noqa: E402
from peagle.model.target.hf_backend import HFBackend  # noqa: E402
from peagle.pipeline.atomic import atomic_write_json  # noqa: E402
from peagle.demo.chat_prompts import chat_prompts  # noqa: E402


def prompt_ids(target: Path, num: int) -> list[list[int]]:
    tokenizer = open_target(target).tokenizer
    texts = [p.text for p in chat_prompts(split="train")[:num]]
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                              tokenize=False) for t in texts]
    return [list(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in rendered]


def random_weight_copy(config_dir: Path) -> Path:
    """A target directory with ``config_dir``'s config and tokenizer and random bf16 weights."""
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="random-target-"))
    for f in config_dir.iterdir():
        shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def one_round(backend, prompts: list[list[int]], batch: int, max_new_tokens: int) -> dict:
    tokens, started = 0, time.perf_counter()
    for start in range(0, len(prompts), batch):
        answers = backend.generate(prompts[start:start + batch], max_new_tokens=max_new_tokens, temperature=0.0,
                                   top_p=1.0, seed=0)
        tokens += sum(len(a) for a in answers)
    seconds = time.perf_counter() - started
    return {"new_tokens": tokens, "seconds": round(seconds, 2), "new_tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--configs", nargs="+", default=["float32:8", "bfloat16:16", "bfloat16:64", "bfloat16:128"],
                        help="DTYPE:BATCH[:CACHE] (hf; CACHE: dynamic or static, default dynamic) or vllm-DTYPE:SEQS")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-weights", action="store_true",
                        help="--target holds only config and tokenizer files: build the model with random weights "
                        "(a GPU machine without the real weights; answers then never end early)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.random_weights:
        args.target = random_weight_copy(args.target)
    prompts = prompt_ids(args.target, args.prompts)
    backends: dict = {}
    rows: dict[str, dict] = {}
    for _ in range(args.repeats):
        for config in args.configs:
            dtype, batch, *cache = config.split(":")
            key = f"{dtype}:{batch}" if dtype.startswith("vllm-") else f"{dtype}:{cache[0] if cache else 'dynamic'}"
            if key not in backends:
                backends[key] = open_backend(args.target, dtype, int(batch), cache, args)
                one_round(backends[key], prompts[:2], 2, 2)  # warm-up: the bf16 copy, first kernels, an engine
            batch_size = len(prompts) if dtype.startswith("vllm-") else int(batch)  # vLLM schedules them itself
            result = one_round(backends[key], prompts, batch_size, args.max_new_tokens)
            best = rows.get(config)
            if best is None or result["new_tokens_per_s"] > best["new_tokens_per_s"]:
                rows[config] = {"config": config, **result}
            print(json.dumps(rows[config]), flush=True)
    baseline = rows[args.configs[0]]["new_tokens_per_s"]
    out = {"machine": {"platform": platform.platform(), "cpu_count": torch.get_num_threads(),
                       "load_average_1m_at_end": os.getloadavg()[0],
                       "torch": torch.__version__, "avx512_bf16": torch.cpu._is_avx512_bf16_supported()},
           "target": str(args.target), "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats,
           "configs": [{**rows[c], "over_first": round(rows[c]["new_tokens_per_s"] / baseline, 2)} for c in args.configs]}
    print(json.dumps(out, indent=1))
    if args.out:
        atomic_write_json(args.out, out)
    for backend in backends.values():
        if hasattr(backend, "close"):
            backend.close()


def open_backend(target: Path, dtype: str, batch: int, cache: list[str], args: argparse.Namespace):
    """The backend of one configuration (see the module docstring)."""
    if dtype.startswith("vllm-"):
        from peagle.model.target.vllm_backend import VllmBackend

        max_seq_len = 1024
        return VllmBackend(target, aux_layer_ids=[1], topk=1, dtype="float32", generation_dtype=dtype[5:],
                           max_seq_len=max_seq_len,
                           engine_kwargs={"max_num_seqs": batch, "max_num_batched_tokens": batch * (max_seq_len + 1)})
    return HFBackend(target, aux_layer_ids=(), topk=1, dtype="auto", device=args.device,
                     generation=cache[0] if cache else "dynamic", generation_dtype=dtype)


if __name__ == "__main__":
    main()
