"""How much the answers a bf16 copy of the target writes differ from the float32 target's own, greedy,
on the same held-out-style prompts: the question behind ``extract --generation-dtype auto`` (bf16 on
CPUs with native bf16 matmuls, ~1.6x faster there).

    python benchmarks/generation_dtype_agreement.py --target "$(peagle target fetch smollm2 | tail -1)" \\
        --out benchmarks/results/cpu/generation_dtype_agreement.json

The stored states and top-k come from the float32 model either way (what the draft learns to match);
only the text differs. Per prompt: the first position where the two greedy answers differ (None:
identical up to the shorter one's end), and the share of positions before the shorter answer's end
where the tokens agree. A draft trained on the bf16-written text sees the float32 target's own
continuation for every prefix up to the first divergence, and the target's own distribution (top-k)
at every position after it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from regenerate_throughput import prompt_ids  # noqa: E402

from peagle.model.target.hf_backend import HFBackend  # noqa: E402
from peagle.pipeline.atomic import atomic_write_json  # noqa: E402


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    prompts = prompt_ids(args.target, args.prompts)
    answers = {}
    for dtype in ("float32", "bfloat16"):
        backend = HFBackend(args.target, aux_layer_ids=(), topk=1, dtype="float32", device="cpu", generation="dynamic",
                            generation_dtype=dtype)
        answers[dtype] = [a for s in range(0, len(prompts), args.batch_size)
                          for a in backend.generate(prompts[s:s + args.batch_size], max_new_tokens=args.max_new_tokens,
                                                    temperature=0.0, top_p=1.0, seed=0)]
    rows = []
    for fp32, bf16 in zip(answers["float32"], answers["bfloat16"]):
        shorter = min(len(fp32), len(bf16))
        agree = sum(x == y for x, y in zip(fp32, bf16)) / shorter if shorter else 1.0
        rows.append({"first_divergence": first_divergence(fp32, bf16), "positional_agreement": round(agree, 4),
                     "len_float32": len(fp32), "len_bfloat16": len(bf16)})
    diverged = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    out = {"machine": {"platform": platform.platform(), "torch": torch.__version__},
           "target": str(args.target), "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "identical_answers": sum(r["first_divergence"] is None for r in rows),
           "median_first_divergence": statistics.median(diverged) if diverged else None,
           "mean_positional_agreement": round(statistics.mean(r["positional_agreement"] for r in rows), 4),
           "mean_len_float32": round(statistics.mean(r["len_float32"] for r in rows), 1),
           "mean_len_bfloat16": round(statistics.mean(r["len_bfloat16"] for r in rows), 1),
           "rows": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    if args.out:
        atomic_write_json(args.out, out)


if __name__ == "__main__":
    main()
