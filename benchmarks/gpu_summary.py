"""The GPU suite's environment record and summary (benchmarks/gpu_suite.sh runs both).

    python benchmarks/gpu_summary.py env --out OUT/parts/env.json
    python benchmarks/gpu_summary.py summary --dir OUT [--smoke]

``summary`` reads the raw output of every part in ``OUT/parts`` (whatever is there: a later
``--parts`` call can complete an earlier run) and writes ``OUT/summary.json`` with the issue's keys.
A key is null when its part did not produce it, and ``null_reasons[key]`` then says why (the part
was skipped, ran out of its budget, failed with this last log line, or ran but this record failed,
e.g. out of memory). ``peagle_top_kernels`` holds the profile of one step per layer count (what
limits the step), ``goals`` compares the figures with issue 14's goals; ``parts`` lists each
part's status, time and finish date. With ``--smoke`` (toy shapes on CPU) the figures only prove
the parts run: the keys keep their names, ``smoke`` is true and ``shapes`` says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

KEYS = ("device", "date", "torch", "peagle_tok_s_1layer_L8192", "speculators_tok_s_1layer_L8192",
        "peagle_tok_s_4layer_L8192", "speculators_tok_s_4layer_L8192", "matmul_tflops_1layer_L8192",
        "longest_context_4layer", "longest_context_4layer_peak_gib", "first_step_s", "recompiles_after_warmup",
        "data_wait_share", "extract_vs_prefill", "cuda_tests")
PART_OF_KEY = {
    "device": "env", "date": "env", "torch": "env",
    "peagle_tok_s_1layer_L8192": "train_step", "peagle_tok_s_4layer_L8192": "train_step",
    "matmul_tflops_1layer_L8192": "train_step",
    "speculators_tok_s_1layer_L8192": "speculators", "speculators_tok_s_4layer_L8192": "speculators",
    "longest_context_4layer": "longest_context", "longest_context_4layer_peak_gib": "longest_context",
    "first_step_s": "train_run", "recompiles_after_warmup": "train_run", "data_wait_share": "train_run",
    "extract_vs_prefill": "extract", "cuda_tests": "cuda_tests",
}
GOALS = {  # issue 14
    "tok_s_1layer >= 1.5 x speculators": ("peagle_over_speculators_1layer", lambda v: v >= 1.5),
    "tok_s_4layer >= 1.3 x speculators": ("peagle_over_speculators_4layer", lambda v: v >= 1.3),
    "longest_context_4layer >= 65536": ("longest_context_4layer", lambda v: v >= 65536),
    "first_step_s < 30": ("first_step_s", lambda v: v < 30),
    "recompiles_after_warmup == 0": ("recompiles_after_warmup", lambda v: v == 0),
    "data_wait_share < 0.02": ("data_wait_share", lambda v: v < 0.02),
    "extract_vs_prefill >= 0.9": ("extract_vs_prefill", lambda v: v >= 0.9),
    "cuda_tests all pass": ("cuda_tests", lambda v: v["failed"] == 0 and v["errors"] == 0 and v["passed"] > 0),
}


def env_record() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__, "python": platform.python_version(),
        "cuda_runtime": torch.version.cuda if cuda else None,
        "gpu_mem_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
    }


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


class Summary:
    """Fills the keys from the parts' files, remembering why each missing one is missing."""

    def __init__(self, parts_dir: Path):
        self.dir = parts_dir
        self.values: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}
        self.status = {p.name.removesuffix(".status.json"): json.loads(p.read_text())
                       for p in sorted(parts_dir.glob("*.status.json"))}

    def part_reason(self, part: str) -> str:
        status = self.status.get(part)
        if status is None:
            return f"part {part} has not run (no {part}.status.json)"
        if status["status"] == "ok":
            return f"part {part} ran but wrote no such figure"
        return f"part {part} {status['status']}: {status['reason']}"

    def put(self, key: str, value: Any, reason: str | None = None) -> None:
        self.values[key] = value
        if value is None:
            self.reasons[key] = reason or self.part_reason(PART_OF_KEY[key])

    def train_step_records(self, file: str, kind: str) -> list[dict]:
        return [r for r in _jsonl(self.dir / file) if r.get("kind") == kind]


def _pick(records: list[dict], layers: int, seq_len: int | None, label: str) -> tuple[dict | None, str | None]:
    """The record of (layers, seq_len) (None: the longest run), or why there is none."""
    mine = [r for r in records if r.get("layers") == layers]
    if seq_len is not None:
        mine = [r for r in mine if r.get("seq_len") == seq_len]
    ok = [r for r in mine if r.get("status") == "ok"]
    if ok:
        return max(ok, key=lambda r: r["seq_len"]), None
    if mine:
        r = mine[-1]
        return None, f"{label} {layers} layer(s) L={r.get('seq_len')}: {r.get('status')} {r.get('error') or r.get('reason') or ''}".strip()
    return None, None


def build_summary(out_dir: Path, smoke: bool, suite_seconds: float | None) -> dict[str, Any]:
    parts = out_dir / "parts"
    s = Summary(parts)
    env = _json(parts / "env.json") or {}
    for key in ("device", "date", "torch"):
        s.put(key, env.get(key))

    length = None if smoke else 8192  # smoke: the toy length the part ran
    steps = s.train_step_records("train_step.jsonl", "train_step")
    reference = s.train_step_records("speculators.jsonl", "model_step")
    top_kernels = {}
    for layers in (1, 4):
        rec, why = _pick(steps, layers, length, "peagle")
        s.put(f"peagle_tok_s_{layers}layer_L8192", rec and rec["tokens_per_s"], why)
        top_kernels[f"{layers}layer"] = rec and rec.get("top_kernels")
        if layers == 1:
            s.put("matmul_tflops_1layer_L8192", rec and rec["matmul_tflops"], why)
        rec, why = _pick(reference, layers, length, "speculators")
        s.put(f"speculators_tok_s_{layers}layer_L8192", rec and rec["tokens_per_s"], why)

    longest = [r for r in s.train_step_records("longest_context.jsonl", "train_step") if r.get("layers") == 4]
    ok = [r for r in longest if r.get("status") == "ok"]
    best = max(ok, key=lambda r: r["seq_len"]) if ok else None
    why = None if ok else (f"no length ran: {longest[0].get('status')} {longest[0].get('error', '')}" if longest else None)
    s.put("longest_context_4layer", best and best["seq_len"], why)
    s.put("longest_context_4layer_peak_gib", best and (best.get("peak_mem_gib") or best.get("peak_rss_gib_process")), why)

    run = _json(parts / "train_run.json") or {}
    run_why = None if run.get("returncode", 0) == 0 else f"peagle train exited {run['returncode']}: " \
        f"{(run.get('stderr_tail') or '').strip().splitlines()[-1:] or ''}"
    for key in ("first_step_s", "recompiles_after_warmup", "data_wait_share"):
        s.put(key, run.get(key), run_why)

    extract = _json(parts / "extract.json") or {}
    s.put("extract_vs_prefill", extract.get("ratio_extract_over_prefill"))

    junit = parts / "cuda_tests.xml"
    cuda_status = s.status.get("cuda_tests", {}).get("status")
    if junit.exists() and cuda_status in ("ok", "error"):  # pytest exits 1 when a test fails: still counts
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        s.put("cuda_tests", {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
                             "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"]})
    else:
        s.put("cuda_tests", None)

    summary: dict[str, Any] = {key: s.values.get(key) for key in KEYS}
    ratios = {}
    for layers in (1, 4):
        ours, theirs = summary[f"peagle_tok_s_{layers}layer_L8192"], summary[f"speculators_tok_s_{layers}layer_L8192"]
        ratios[f"peagle_over_speculators_{layers}layer"] = round(ours / theirs, 3) if ours and theirs else None
    summary.update(ratios, peagle_top_kernels=top_kernels)
    summary["goals"] = {}
    for goal, (key, test) in GOALS.items():
        value = summary.get(key)
        summary["goals"][goal] = None if (value is None or smoke) else bool(test(value))
    summary.update(smoke=smoke, shapes="toy shapes on CPU (smoke run): figures prove the parts run, nothing more"
                   if smoke else "8B-shaped draft, K = 8, r = 0.7, r_min = 0.2 (issue 14)",
                   null_reasons={k: v for k, v in s.reasons.items() if summary.get(k) is None},
                   parts=s.status, suite_seconds=suite_seconds)
    return summary


def print_table(summary: dict[str, Any]) -> None:
    rows = [(key, summary[key]) for key in KEYS] + [(k, summary[k]) for k in summary if k.startswith("peagle_over")]
    width = max(len(k) for k, _ in rows)
    print(f"\n{'key':<{width}}  value")
    for key, value in rows:
        shown = json.dumps(value) if value is not None else f"null ({summary['null_reasons'].get(key, '')})"
        print(f"{key:<{width}}  {shown[:150]}")
    met = {g: v for g, v in summary["goals"].items() if v is not None}
    if met:
        print("\ngoals: " + "; ".join(f"{g}: {'met' if v else 'NOT met'}" for g, v in met.items()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="write the environment record")
    env.add_argument("--out", type=Path, required=True)
    summ = sub.add_parser("summary", help="write DIR/summary.json from DIR/parts and print the table")
    summ.add_argument("--dir", type=Path, required=True)
    summ.add_argument("--smoke", action="store_true")
    summ.add_argument("--suite-seconds", type=float, default=None)
    args = ap.parse_args(argv)
    if args.command == "env":
        record = env_record()
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record))
        return
    summary = build_summary(args.dir, args.smoke, args.suite_seconds)
    tmp = args.dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(args.dir / "summary.json")
    print_table(summary)
    print(f"\nsummary: {args.dir / 'summary.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
