"""Serve the real-scale run's drafts here (issue 36): each export that came back from the GPU, made
whole again with the local target's embedding, measured by vLLM and by our own loop on the held-out
prompts at K = 5; then vLLM with the best draft at K = 2..8 (a P-EAGLE draft up to its trained depths) against vLLM without a draft.

    python benchmarks/real_scale_serve.py --results benchmarks/results/gpu/DATE-DEVICE-real \\
        --target "$(peagle target fetch smollm2 | tail -1)" [--work /tmp/real-serve] [--ks 2,3,4,5,6,7,8]

Reads RESULTS/transport/NAME (exports without the target embedding: gpu_real_scale.py) and
RESULTS/data/serve-prompts.jsonl (the 32 held-out prompts the CPU figures use); writes
RESULTS/served.json (per export: AL and per-depth acceptance in vLLM and our loop, tokens per target
forward, greedy output equal to the target's; the K sweep with tokens/s and speedup). The whole
exports and the reports go to --work (git-ignored: rebuilt from the committed transport files).
A finished report in --work is reused, so a cut-short run resumes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle.model.speculators_format import with_target_embedding  # noqa: E402
from peagle.pipeline.atomic import atomic_write_json  # noqa: E402

KEYS = ("acceptance_length", "per_depth_acceptance", "tokens_per_target_forward", "greedy_output_matches_target_only",
        "spec_tokens_per_second", "plain_tokens_per_second", "speedup", "num_steps")


def evaluate(export: Path, report: Path, *, target: Path, prompts: Path, k: int, modes: str, max_prompts: int,
             max_new_tokens: int) -> dict:
    """``peagle eval`` of one export at K = ``k`` (reused when its report exists)."""
    if not (report / "report.json").exists():
        cmd = [sys.executable, "-m", "peagle", "eval", str(export), "--target", str(target), "--prompts", str(prompts),
               "--out", str(report), "--num-depths", str(k), "--mode", modes, "--max-prompts", str(max_prompts),
               "--max-new-tokens", str(max_new_tokens), "--quiet"]
        print("$ peagle " + " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True)
    full = json.loads((report / "report.json").read_text())
    out = {}
    for mode in modes.split(","):
        if mode in full:
            out[mode] = {key: full[mode].get(key) for key in KEYS if key in full[mode]}
    return out


def relative_difference(a: float | None, b: float | None) -> float | None:
    return None if not a or b is None else round((b - a) / a, 4)


def serve(results: Path, target: Path, work: Path, *, ks: list[int], max_prompts: int, max_new_tokens: int,
          only: list[str] | None = None) -> dict:
    """Serve every export in RESULTS/transport (``only``: those named), then the K sweep of the best."""
    prompts = results / "data" / "serve-prompts.jsonl"
    served: dict = {"prompts": str(prompts), "max_prompts": max_prompts, "max_new_tokens": max_new_tokens,
                    "target": str(target), "exports": {}}
    for transport in sorted((results / "transport").iterdir()):
        if only is not None and transport.name not in only:
            continue
        export = work / "exports" / transport.name
        if not export.exists():
            with_target_embedding(transport, target, export)
        record = evaluate(export, work / "reports" / transport.name / "k5", target=target, prompts=prompts, k=5,
                          modes="vllm,online", max_prompts=max_prompts, max_new_tokens=max_new_tokens)
        vllm_al = (record.get("vllm") or {}).get("acceptance_length")
        own_al = (record.get("online") or {}).get("acceptance_length")
        record["own_loop_vs_vllm_relative_difference"] = relative_difference(vllm_al, own_al)
        served["exports"][transport.name] = record
        print(f"{transport.name}: AL {vllm_al} in vLLM, {own_al} in our loop", flush=True)
    best = max(served["exports"], key=lambda n: served["exports"][n]["vllm"]["acceptance_length"])
    sweep = {}
    config = json.loads((work / "exports" / best / "config.json").read_text())
    trained = (config.get("peagle") or {}).get("num_depths_trained")
    if config.get("speculators_model_type") == "peagle" and trained:  # `peagle eval` refuses a deeper K for P-EAGLE
        skipped, ks = [k for k in ks if k > trained], [k for k in ks if k <= trained]
        if skipped:
            print(f"{best}: trained at {trained} depths, so K = {', '.join(map(str, skipped))} not served", flush=True)
    for k in ks:
        if k == 5:  # measured already, in the same vLLM settings: one engine pair less
            sweep[str(k)] = served["exports"][best]["vllm"]
            continue
        result = evaluate(work / "exports" / best, work / "reports" / best / f"sweep-k{k}", target=target,
                          prompts=prompts, k=k, modes="vllm", max_prompts=max_prompts, max_new_tokens=max_new_tokens)
        sweep[str(k)] = result["vllm"]
        print(f"{best} K={k}: speedup {result['vllm'].get('speedup')}", flush=True)
    fastest = max(sweep, key=lambda k: sweep[k].get("speedup") or 0.0)
    served["best"] = {"export": best, "k_sweep": sweep, "fastest_k": int(fastest),
                      "speedup_over_plain_vllm": sweep[fastest].get("speedup")}
    return served


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/peagle-real-serve"))
    parser.add_argument("--ks", default="2,3,4,5,6,7,8")
    parser.add_argument("--max-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    served = serve(args.results, args.target, args.work, ks=[int(k) for k in args.ks.split(",")],
                   max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens)
    atomic_write_json(args.results / "served.json", served)
    print(f"wrote {args.results / 'served.json'}", flush=True)


if __name__ == "__main__":
    main()
