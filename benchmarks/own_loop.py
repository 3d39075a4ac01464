"""Where our own loop's time goes when a trained draft decodes real prompts, and what two settings of
the target do to it: its attention under a mask (transformers' sdpa against peagle's
``gqa_attention``) and ``torch.compile``.

    python benchmarks/own_loop.py --export EXPORT --prompts PROMPTS.jsonl --out benchmarks/results/cpu/own_loop.json

``benchmarks/step_cost.py`` times a step's parts one at a time, in turns, at a fixed context; eval's K
recommendation reads those. This one times the loop itself (``peagle.stages.eval.online``: the same
functions ``peagle eval --mode online`` runs), one request at a time, speculative and plain decoding
of each prompt in turn, with the target's forwards and the drafter's proposals clocked as they happen:
per speculative step the verification (one target forward over K + 1 tokens), the proposal and the
rest (acceptance, the cache crop, the loop), per plain token the forward and the rest. So what the
parts' sum misses shows up, and an A/B of a setting is read on the loop's own ratio.

* ``attention``: the loop with the target on transformers' sdpa and on ``gqa_attention`` (what
  ``HFTarget.load`` uses), alternating on one model, ``--repeats`` times each: the same tokens, the
  step's cost.
* ``compiled plain``: plain decoding with the target's forward under ``torch.compile`` (dynamic
  shapes) against the eager one, and the verification's forward compiled the same way: whether our
  loop's baseline is the target's fastest setting in transformers (``--no-compiled`` skips it: ~3-5
  minutes of compile on 2 cores).

Quiet cores only: every figure is wall time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from peagle.pipeline.atomic import atomic_write_json  # noqa: E402


class ClockedTarget:
    """A TargetLM whose forwards are clocked: ``calls`` holds (tokens, seconds) of each."""

    def __init__(self, target):
        self.target, self.calls = target, []

    def forward(self, input_ids_L, cache):
        start = time.perf_counter()
        out = self.target.forward(input_ids_L, cache)
        self.calls.append((len(input_ids_L), time.perf_counter() - start))
        return out


def decode(target, drafter, prompts: list[list[int]], *, k: int, max_new_tokens: int, stops: set[int]) -> dict:
    """Speculative then plain decoding of each prompt; where each loop's time went."""
    from peagle.stages.eval import online

    spec = {"seconds": 0.0, "tokens": 0, "steps": 0, "verify_s": 0.0, "draft_s": 0.0, "prefill_s": 0.0}
    plain = {"seconds": 0.0, "tokens": 0, "forward_s": 0.0, "prefill_s": 0.0}
    proposals: list[float] = []

    def clocked_drafter(*args):
        start = time.perf_counter()
        out = drafter(*args)
        proposals.append(time.perf_counter() - start)
        return out

    for prompt in prompts:
        clocked, proposals[:] = ClockedTarget(target), []
        g = online.speculative_generate(clocked, clocked_drafter, prompt, num_depths=k, max_new_tokens=max_new_tokens,
                                        sampler=online.Sampler(), stop_ids=stops)
        spec["seconds"] += g.seconds
        spec["tokens"] += len(g.tokens)
        spec["steps"] += g.num_target_forwards - 1
        spec["prefill_s"] += clocked.calls[0][1]
        spec["verify_s"] += sum(s for _, s in clocked.calls[1:])
        spec["draft_s"] += sum(proposals)
        clocked = ClockedTarget(target)
        p = online.plain_generate(clocked, prompt, max_new_tokens=max_new_tokens, sampler=online.Sampler(),
                                  stop_ids=stops)
        plain["seconds"] += p.seconds
        plain["tokens"] += len(p.tokens)
        plain["prefill_s"] += clocked.calls[0][1]
        plain["forward_s"] += sum(s for _, s in clocked.calls[1:])
    steps, decoded = spec["steps"], plain["tokens"] - len(prompts)  # plain: one forward per token after the first
    spec_rate, plain_rate = spec["tokens"] / spec["seconds"], plain["tokens"] / plain["seconds"]
    return {"acceptance_length": spec["tokens"] / steps if steps else None,
            "spec_tokens_per_second": spec_rate, "plain_tokens_per_second": plain_rate, "speedup": spec_rate / plain_rate,
            "spec_step_ms": 1e3 * (spec["seconds"] - spec["prefill_s"]) / steps,
            "verify_ms": 1e3 * spec["verify_s"] / steps, "draft_ms": 1e3 * spec["draft_s"] / steps,
            "spec_rest_ms": 1e3 * (spec["seconds"] - spec["prefill_s"] - spec["verify_s"] - spec["draft_s"]) / steps,
            "plain_forward_ms": 1e3 * plain["forward_s"] / decoded,
            "plain_rest_ms": 1e3 * (plain["seconds"] - plain["prefill_s"] - plain["forward_s"]) / decoded,
            "verify_over_plain_forward": (spec["verify_s"] / steps) / (plain["forward_s"] / decoded),
            "step_over_plain_token": ((spec["seconds"] - spec["prefill_s"]) / steps)
            / ((plain["seconds"] - plain["prefill_s"]) / decoded)}


def attention_ab(target_dir: str, draft, prompts, *, k: int, max_new_tokens: int, stops: set[int], repeats: int
                 ) -> dict[str, list[dict]]:
    """The loop on transformers' sdpa and on gqa_attention, alternating on one model (two models would
    sit in different memory, and that alone moved a loop's speed by ~5 % here)."""
    from peagle.model.gqa_attention import NAME
    from peagle.stages.eval import online

    target = online.HFTarget.load(target_dir, draft.config.aux_layer_ids, dtype=draft.fc.weight.dtype)
    drafter = online.proposer_drafter(draft, target.vocab_size)
    settings = {"sdpa": "sdpa", "gqa_attention": NAME}
    for implementation in settings.values():  # warm-up: first-call allocations out of the timings
        target.model.set_attn_implementation(implementation)
        decode(target, drafter, prompts[:1], k=k, max_new_tokens=16, stops=stops)
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for i in range(repeats):
        for name, implementation in settings.items():
            target.model.set_attn_implementation(implementation)
            runs[name].append(decode(target, drafter, prompts, k=k, max_new_tokens=max_new_tokens, stops=stops))
            r = runs[name][-1]
            print(f"{name} run {i + 1}: {r['speedup']:.3f}x (AL {r['acceptance_length']:.3f}); step "
                  f"{r['spec_step_ms']:.1f} ms = verify {r['verify_ms']:.1f} + draft {r['draft_ms']:.1f} + rest "
                  f"{r['spec_rest_ms']:.1f}; plain token {r['plain_forward_ms'] + r['plain_rest_ms']:.1f} ms", flush=True)
    target.model.set_attn_implementation(NAME)
    return runs


def compiled_plain(target_dir: str, aux_layer_ids: list[int], dtype: torch.dtype, prompt: list[int], *,
                   k: int, tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    """ms per token of plain decoding with the target eager and compiled (``HFTarget(compiled=True)``,
    what ``peagle eval --online-compile`` serves), and of a verification forward (K + 1 tokens over
    the cache, then cropped back) both ways, timed as eval times its step costs
    (``speed.interleaved_medians``)."""
    from peagle.stages.eval import online, speed

    out: dict[str, Any] = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        started = time.perf_counter()
        target = online.HFTarget.load(target_dir, aux_layer_ids, dtype=dtype, compiled=compiled)
        state = online.prefill(target, prompt, online.Sampler())
        kept = state.cache.get_seq_length()

        def plain() -> None:
            online.plain_generate(target, prompt, max_new_tokens=tokens, sampler=online.Sampler())

        def verification() -> None:
            online.verify(target, state, [state.tokens[-1]] * k)
            speed._crop_to(state.cache, kept)

        plain()  # a compiled target compiles here: its graphs for prefill, one token and K + 1
        verification()
        if compiled:
            out["compile_s"] = time.perf_counter() - started
        plain_s, verify_s = speed.interleaved_medians([plain, verification], repeats=repeats, warmup=1)
        out[f"{name}_plain_ms"] = 1e3 * plain_s / tokens
        out[f"{name}_verify_ms"] = 1e3 * verify_s
    print(f"plain decoding: eager {out['eager_plain_ms']:.1f} ms a token, compiled {out['compiled_plain_ms']:.1f} "
          f"(compile {out['compile_s']:.0f} s); verification of {k + 1}: eager {out['eager_verify_ms']:.1f} ms, "
          f"compiled {out['compiled_verify_ms']:.1f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True, help="a trained draft's export (servable: peagle export)")
    parser.add_argument("--target", help="the target model dir (default: the packaged SmolLM2)")
    parser.add_argument("--prompts", required=True, help="chat prompts, JSONL (peagle eval --prompts)")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="drafts a step")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each attention setting, alternating")
    parser.add_argument("--no-compiled", action="store_true", help="skip the torch.compile measurement")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/own_loop.json"))
    args = parser.parse_args(argv)
    from peagle.model.target.packaged import fetch_target
    from peagle.model.speculators_format import load_export
    from peagle.model.target.directory import load_tokenizer
    from peagle.stages.eval.prompts import prompts_from_file, stop_token_ids

    torch.set_num_threads(os.cpu_count() or 1)
    target_dir = args.target or str(fetch_target("smollm2"))
    draft = load_export(args.export).draft.to(dtype=torch.bfloat16)
    tokenizer = load_tokenizer(target_dir)
    prompts = prompts_from_file(args.prompts, tokenizer)[: args.num_prompts]
    stops = set(stop_token_ids(tokenizer, target_dir))
    result = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                          "load_before": os.getloadavg()},
              "date": time.strftime("%Y-%m-%d %H:%M"), "settings": {**vars(args), "out": str(args.out)},
              "dtype": "bfloat16", "method": draft.config.method}
    runs = attention_ab(target_dir, draft, prompts, k=args.k, max_new_tokens=args.max_new_tokens, stops=stops,
                        repeats=args.repeats)
    result["attention"] = {name: {"runs": rs, "median_speedup": statistics.median(r["speedup"] for r in rs),
                                  "median_verify_over_plain_forward":
                                      statistics.median(r["verify_over_plain_forward"] for r in rs)}
                           for name, rs in runs.items()}
    if not args.no_compiled:
        result["compiled"] = compiled_plain(target_dir, list(draft.config.aux_layer_ids), torch.bfloat16, prompts[0],
                                            k=args.k)
    result["machine"]["load_after"] = os.getloadavg()
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
