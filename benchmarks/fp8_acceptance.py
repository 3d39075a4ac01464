"""Acceptance of the demo draft trained on an fp8 store vs the bf16 store of the same data, same seed.

    python benchmarks/fp8_acceptance.py --out /tmp/peagle-fp8-demo --json benchmarks/results/cpu/fp8_acceptance.json

1. ``peagle demo --target tiny --out OUT/bf16`` (the whole demo, bf16 store; reused when its summary exists);
2. ``peagle store convert OUT/bf16/store --hidden-dtype fp8 --out OUT/fp8/store``: the same rows, in fp8
   (byte-identical to extracting with ``--hidden-dtype fp8``: tests/stages/store/test_convert.py);
3. ``peagle demo --target tiny --out OUT/fp8 --hidden-dtype fp8``: the demo finds the converted store complete (its
   extract step has nothing to do) and runs vocab, train, export and eval with the same seed.

Reports acceptance length (AL) and per-depth acceptance in vLLM (parallel drafting), in our own loop
and on teacher-forced chains, for both, and the relative difference of the fp8 AL (goal: within 1% in
vLLM). The stores hold the same tokens and top-k; only the aux rows differ (by fp8's rounding).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path


def peagle(*args: str) -> None:
    print(f"$ peagle {shlex.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "peagle", *args], check=True)


def demo(out: Path, seed: int, hidden_dtype: str, extra: list[str]) -> dict:
    if not (out / "summary.json").exists():
        # the tiny target: what results/cpu/fp8_acceptance.json was measured on (--demo-args '--target
        # smollm2' measures the real model; a later --target wins)
        peagle("demo", "--target", "tiny", "--out", str(out), "--seed", str(seed), "--hidden-dtype", hidden_dtype,
               *extra)
    return json.loads((out / "summary.json").read_text())


def acceptance(summary: dict) -> dict:
    comparison = summary["eval"].get("comparison", {})
    return {mode: {"acceptance_length": section.get("acceptance_length"),
                   "per_depth_acceptance": section.get("per_depth_acceptance")}
            for mode, section in comparison.items() if isinstance(section, dict) and "acceptance_length" in section}


def relative(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else (a - b) / b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/peagle-fp8-demo", help="demo directories (reused when present)")
    parser.add_argument("--json", default=None, help="write results here (default: stdout only)")
    parser.add_argument("--seed", type=int, default=0, help="demo seed (data, training, sampling)")
    parser.add_argument("--demo-args", default="", help="more `peagle demo` flags, e.g. '--train-steps 300'")
    args = parser.parse_args()
    out, extra = Path(args.out), shlex.split(args.demo_args)
    started = time.monotonic()

    bf16 = demo(out / "bf16", args.seed, "bf16", extra)
    # Resumable: a complete conversion finds nothing to do.
    peagle("store", "convert", str(out / "bf16" / "store"), "--hidden-dtype", "fp8", "--out", str(out / "fp8" / "store"))
    fp8 = demo(out / "fp8", args.seed, "fp8", extra)
    runs = {"bf16": acceptance(bf16), "fp8": acceptance(fp8)}
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "seed": args.seed, "demo_args": extra,
        "store_bytes": {"bf16": bf16["store"]["bytes"], "fp8": fp8["store"]["bytes"]},
        "train_final_loss": {"bf16": bf16["train"]["final_loss"], "fp8": fp8["train"]["final_loss"]},
        "acceptance": runs,
        "fp8_vs_bf16_relative_difference": {
            mode: relative(runs["fp8"].get(mode, {}).get("acceptance_length"),
                           runs["bf16"].get(mode, {}).get("acceptance_length")) for mode in runs["bf16"]},
    }
    result["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
