"""`peagle store check` on a real store: does a clean store pass, is each planted fault caught, how fast?

    python benchmarks/store_check.py --store /tmp/peagle-fp8-demo/bf16/store \\
        --target ~/.cache/peagle/demo-target-... --out /tmp/peagle-bench-check --json benchmarks/results/cpu/store_check.json

The unit tests plant faults in stores of random-weight tiny targets, whose text no target predicts;
this runs the same checks on a store of a trained target (the demo's: its own regenerated answers),
where the statistics that need a real model -- top-1 agreement for misalignment, the attention
sink's norms for the outlier judgement -- mean something. For the clean store and for copies with
one fault each (peagle.testing.store_faults: a sample zeroed, a sample's rows shifted by one, a
shard's rows shifted by one, a sample's states copied from another), and for the clean store checked
against another target of the same shape (the demo target's untrained base), it records which checks
failed and their one-line explanations, and the check's speed (tokens/s, reading every row;
``--target`` recomputes ``--samples`` samples on the CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.store import open_store
from peagle.schemas import store as S
from peagle.schemas.check_config import CheckConfig
from peagle.stages.store.check import check_store
from peagle.testing import store_faults as F
from peagle.demo.target import DemoTargetSpec
from peagle.demo.tiny_target import build_tiny_target


def run_check(store: Path, target: str | None, samples: int) -> dict:
    started = time.perf_counter()
    report = check_store(CheckConfig(store=str(store), target=target, samples=samples, device="cpu"),
                         progress=False, echo=lambda _: None)
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 2), "tokens_per_s": round(report.num_tokens / seconds),
            "failed": {f.key: f.explanation for f in report.failed},
            "findings": {f.key: {"count": f.count, "allowed": f.allowed, "judged": f.judged} for f in report.findings},
            "target": None if report.target is None else {k: v for k, v in report.target.items() if k != "samples"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="a clean store of a trained target (the demo's)")
    parser.add_argument("--target", required=True, help="the target it was extracted from")
    parser.add_argument("--samples", type=int, default=32, help="samples --target recomputes")
    parser.add_argument("--out", default="/tmp/peagle-bench-check", help="where the faulty copies go")
    parser.add_argument("--json", default=None, help="write results here (default: stdout only)")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    source = open_store(args.store)
    shard = source.shards[len(source.shards) // 2].index
    ids = read_shard_rows(source, shard, ["sample_id"]).column("sample_id").to_pylist()
    # Another target of the demo target's shape: its untrained base (same tokenizer, other weights).
    other = build_tiny_target(out / "untrained-base", DemoTargetSpec().base)

    faults = {  # name -> (plant, check with --target too)
        "clean": (lambda s: None, True),
        "zeroed_sample": (lambda s: F.zero_sample_rows(s, shard, ids[1]), False),
        "sample_shifted_by_one": (lambda s: F.shift_sample_rows(s, shard, ids[2]), False),
        "shard_shifted_by_one": (lambda s: F.shift_shard_rows(s, shard), True),
        "states_copied_from_another_sample": (lambda s: F.copy_sample_states(s, shard, ids[3], ids[4]), False),
    }
    results = {"machine": {"platform": platform.platform(), "python": platform.python_version()},
               "store": str(Path(args.store).resolve()), "num_tokens": source.num_tokens,
               "hidden_dtype": source.settings.hidden_dtype, "planted_in": {"shard": shard, "samples": ids[1:5]},
               "runs": {}}
    for name, (plant, with_target) in faults.items():
        store = Path(shutil.copytree(args.store, out / name, ignore=shutil.ignore_patterns(S.VOCAB_DIR)))
        plant(store)
        results["runs"][name] = {"without_target": run_check(store, None, args.samples)}
        if with_target:
            results["runs"][name]["with_target"] = run_check(store, args.target, args.samples)
        print(name, json.dumps({k: v["failed"] for k, v in results["runs"][name].items()}), flush=True)
    results["runs"]["checked_against_another_target"] = {"with_target": run_check(Path(args.store), str(other),
                                                                                   args.samples)}
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
