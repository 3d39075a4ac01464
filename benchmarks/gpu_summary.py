"""The GPU suite's environment record and summary (benchmarks/gpu_suite.sh runs both).

    python benchmarks/gpu_summary.py env --out OUT/parts/env.json
    python benchmarks/gpu_summary.py summary --dir OUT [--smoke]

``summary`` reads the raw output of every part in ``OUT/parts`` (whatever is there: a later
``--parts`` call can complete an earlier run) and writes ``OUT/summary.json`` with every figure
issue 24's goals name (``KEYS``). A key is null when its part did not produce it, and
``null_reasons[key]`` then says why (the part was skipped, ran out of its budget, failed with this
last log line, or ran but this record failed, e.g. out of memory). Besides the keys:
``peagle_over_speculators_{1,4}layer``; ``peagle_top_kernels`` (the profile of one step per layer
count) and ``slower_than_goal`` (for each layer count short of its goal: the ratio and the top
kernels, what the note must explain); ``attention`` (every flex variant's forward+backward and
forward time, its difference from ``auto``, the best variant, and the reference's attention-only
figures); ``goals`` (met / not met / null); ``parts`` (each part's status, time and finish date).
With ``--smoke`` (toy shapes on CPU) the figures only prove the parts run: the keys keep their
names, ``smoke`` is true and ``shapes`` says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

KEYS = ("device", "date", "torch", "peagle_tok_s_1layer_L8192", "speculators_tok_s_1layer_L8192",
        "peagle_tok_s_4layer_L8192", "speculators_tok_s_4layer_L8192", "matmul_tflops_1layer_L8192",
        "peagle_peak_gib_4layer_L8192", "fp8_tok_s_4layer_L8192", "attention_fwd_bwd_ms_auto",
        "attention_best_variant", "speculators_attention_fwd_bwd_ms", "longest_context_4layer",
        "longest_context_4layer_peak_gib", "longest_context_4layer_step_s", "first_step_s", "startup_s",
        "recompiles_after_warmup", "data_wait_share", "cuda_tests", "extract_vs_prefill")
PART_OF_KEY = {
    "device": "env", "date": "env", "torch": "env",
    "peagle_tok_s_1layer_L8192": "train_step", "peagle_tok_s_4layer_L8192": "train_step",
    "matmul_tflops_1layer_L8192": "train_step", "peagle_peak_gib_4layer_L8192": "train_step",
    "fp8_tok_s_4layer_L8192": "train_step",
    "speculators_tok_s_1layer_L8192": "speculators", "speculators_tok_s_4layer_L8192": "speculators",
    "attention_fwd_bwd_ms_auto": "attention", "attention_best_variant": "attention",
    "speculators_attention_fwd_bwd_ms": "attention",
    "longest_context_4layer": "longest_context", "longest_context_4layer_peak_gib": "longest_context",
    "longest_context_4layer_step_s": "longest_context",
    "first_step_s": "train_run", "startup_s": "train_run", "recompiles_after_warmup": "train_run",
    "data_wait_share": "train_run", "extract_vs_prefill": "extract", "cuda_tests": "cuda_tests",
}
MEMORY_GOAL_GIB = 80
GOALS = {  # issue 24
    "tok_s_1layer >= 1.5 x speculators": ("peagle_over_speculators_1layer", lambda v: v >= 1.5),
    "tok_s_4layer >= 1.3 x speculators": ("peagle_over_speculators_4layer", lambda v: v >= 1.3),
    "longest_context_4layer >= 131072 within 80 GiB": ("longest_context_4layer", lambda v: v >= 131072),
    "first_step_s < 30": ("first_step_s", lambda v: v < 30),
    "recompiles_after_warmup == 0": ("recompiles_after_warmup", lambda v: v == 0),
    "data_wait_share < 0.02": ("data_wait_share", lambda v: v < 0.02),
    "extract_vs_prefill >= 0.9": ("extract_vs_prefill", lambda v: v >= 0.9),
    "cuda_tests all pass": ("cuda_tests", lambda v: v["failed"] == 0 and v["errors"] == 0 and v["passed"] > 0),
}
RATIO_GOALS = {1: 1.5, 4: 1.3}


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


def _pick(records: list[dict], layers: int, seq_len: int | None, label: str,
          fp8: bool = False) -> tuple[dict | None, str | None]:
    """The record of (layers, seq_len, fp8 or not) (seq_len None: the longest that ran), or why there is none."""
    mine = [r for r in records if r.get("layers") == layers and bool(r.get("fp8_matmuls")) == fp8]
    if seq_len is not None:
        mine = [r for r in mine if r.get("seq_len") == seq_len]
    ok = [r for r in mine if r.get("status") == "ok"]
    if ok:
        return max(ok, key=lambda r: r["seq_len"]), None
    if mine:
        r = mine[-1]
        return None, f"{label} {layers} layer(s) L={r.get('seq_len')}: {r.get('status')} {r.get('error') or r.get('reason') or ''}".strip()
    return None, None


def cuda_test_failures(parts: Path) -> dict[str, str]:
    """Each failed test's first error line (``E ...``), from the failure log tests/conftest.py writes
    as tests fail (``PEAGLE_TEST_FAILURE_LOG``): there even when pytest was stopped at the limit."""
    path = parts / "cuda_tests_failures.txt"
    failures: dict[str, str] = {}
    test = None
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("=== "):
            test = line[4:]
            failures[test] = ""
        elif test is not None and not failures[test] and line.startswith("E "):
            failures[test] = line[1:].strip()[:300]
    return failures


def cuda_test_counts(parts: Path, log: Path) -> dict[str, Any] | None:
    """pytest's counts: from the junit file, else (a run stopped before writing it) from the ``-v`` log;
    with ``failures`` (test -> first error line) where a test failed."""
    counts = _cuda_test_counts(parts, log)
    failures = cuda_test_failures(parts)
    return {**counts, "failures": failures} if counts is not None and failures else counts


def _cuda_test_counts(parts: Path, log: Path) -> dict[str, Any] | None:
    junit = parts / "cuda_tests.xml"
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
                "errors": n["errors"], "skipped": n["skipped"]}
    if not log.exists():
        return None
    seen: dict[str, str] = {}
    for line in log.read_text(errors="replace").splitlines():  # "tests/x.py::t PASSED" or "[gw0] [ 5%] PASSED tests/x.py::t"
        match = re.search(r"(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)|(PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+)", line)
        if match:
            test, outcome = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
            seen[test] = outcome
    if not seen:
        return None
    outcomes = list(seen.values())
    return {"passed": outcomes.count("PASSED"), "failed": outcomes.count("FAILED"), "errors": outcomes.count("ERROR"),
            "skipped": outcomes.count("SKIPPED"), "from_log": True}


def attention_table(parts: Path) -> tuple[dict[str, Any], list[dict], list[dict]]:
    """(variant -> figures, our records, the reference's attention-only records)."""
    ours = [r for r in _jsonl(parts / "attention.jsonl") if r.get("kind") == "attention"]
    reference = [r for r in _jsonl(parts / "speculators_attn.jsonl") if r.get("kind") == "attn_baseline"]
    table = {r["variant"]: {k: r.get(k) for k in ("status", "fwd_bwd_ms", "fwd_ms", "bwd_over_fwd", "useful_tflops",
                                                  "first_call_s", "max_rel_diff_vs_auto", "error")}
             for r in ours}
    return table, ours, reference


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
        else:
            s.put("peagle_peak_gib_4layer_L8192", rec and (rec.get("peak_mem_gib") or rec.get("peak_rss_gib_process")),
                  why)
        rec, why = _pick(reference, layers, length, "speculators")
        s.put(f"speculators_tok_s_{layers}layer_L8192", rec and rec["tokens_per_s"], why)
    fp8_layers = 1 if smoke else 4  # the smoke run's fp8 configuration has one layer
    rec, why = _pick(steps, fp8_layers, length, "peagle --fp8-matmuls", fp8=True)
    s.put("fp8_tok_s_4layer_L8192", rec and rec["tokens_per_s"], why)

    table, ours, attn_reference = attention_table(parts)
    auto = table.get("auto", {})
    s.put("attention_fwd_bwd_ms_auto", auto.get("fwd_bwd_ms") or auto.get("fwd_ms"),
          f"auto: {auto.get('status')} {auto.get('error') or ''}".strip() if auto else None)
    timed = {name: (v.get("fwd_bwd_ms") or v.get("fwd_ms")) for name, v in table.items() if v.get("status") == "ok"}
    s.put("attention_best_variant", min(timed, key=timed.get) if timed else None)
    flex_reference = [r for r in attn_reference if str(r.get("impl", "")).startswith("flex") and r.get("status") == "ok"]
    s.put("speculators_attention_fwd_bwd_ms", flex_reference[0]["fwd_bwd_ms"] if flex_reference else None,
          f"the reference's flex attention: {attn_reference[0].get('status')} {attn_reference[0].get('error') or ''}"
          .strip() if attn_reference else
          "the reference's attention-only mode did not run (no --speculators-anchor, smoke run, or no time left)")

    longest = [r for r in s.train_step_records("longest_context.jsonl", "train_step") if r.get("layers") == 4]
    ok = [r for r in longest if r.get("status") == "ok"
          and (r.get("peak_mem_gib") is None or r["peak_mem_gib"] <= MEMORY_GOAL_GIB)]
    best = max(ok, key=lambda r: r["seq_len"]) if ok else None
    why = None if ok else (f"no length ran: {longest[0].get('status')} {longest[0].get('error', '')}" if longest else None)
    s.put("longest_context_4layer", best and best["seq_len"], why)
    s.put("longest_context_4layer_peak_gib", best and (best.get("peak_mem_gib") or best.get("peak_rss_gib_process")), why)
    s.put("longest_context_4layer_step_s", best and round(best["median_ms"] / 1e3, 2), why)

    run = _json(parts / "train_run.json") or {}
    run_why = None
    if run.get("killed"):
        run_why = f"peagle train was stopped at the part's limit after {run.get('steps', 0)} step(s)"
    elif run.get("returncode") not in (0, None):
        run_why = f"peagle train exited {run['returncode']}: {(run.get('output_tail') or '').strip().splitlines()[-1:]}"
    for key in ("first_step_s", "startup_s", "recompiles_after_warmup", "data_wait_share"):
        s.put(key, run.get(key), run_why)

    extract = _json(parts / "extract.json") or {}
    s.put("extract_vs_prefill", extract.get("ratio_extract_over_prefill"))

    cuda_status = s.status.get("cuda_tests", {}).get("status")
    counts = cuda_test_counts(parts, out_dir / "logs" / "cuda_tests.log") if cuda_status in ("ok", "error", "timeout") \
        else None  # pytest exits 1 when a test fails: its counts still count
    ran = counts and counts["passed"] + counts["failed"] + counts["errors"] + counts["skipped"] > 0
    s.put("cuda_tests", counts if ran else None,
          None if ran or cuda_status is None else f"no test ran: {s.part_reason('cuda_tests')}")

    summary: dict[str, Any] = {key: s.values.get(key) for key in KEYS}
    ratios, slower = {}, {}
    for layers in (1, 4):
        ours_tok, theirs = summary[f"peagle_tok_s_{layers}layer_L8192"], summary[f"speculators_tok_s_{layers}layer_L8192"]
        ratio = round(ours_tok / theirs, 3) if ours_tok and theirs else None
        ratios[f"peagle_over_speculators_{layers}layer"] = ratio
        if ratio is not None and ratio < RATIO_GOALS[layers]:
            slower[f"{layers}layer"] = {"ratio": ratio, "goal": RATIO_GOALS[layers],
                                        "top_kernels": top_kernels[f"{layers}layer"]}
    fp8, bf16 = summary["fp8_tok_s_4layer_L8192"], summary["peagle_tok_s_4layer_L8192"]
    summary.update(ratios, fp8_over_bf16_4layer=round(fp8 / bf16, 3) if fp8 and bf16 and not smoke else None,
                   peagle_top_kernels=top_kernels, slower_than_goal=slower,
                   attention={"variants": table, "reference": attn_reference,
                              "row": {k: ours[0].get(k) for k in ("seq_len", "cod_len", "mask_density",
                                                                  "block_sparsity_pct")} if ours else None})
    summary["goals"] = {}
    for goal, (key, test) in GOALS.items():
        value = summary.get(key)
        summary["goals"][goal] = None if (value is None or smoke) else bool(test(value))
    summary.update(smoke=smoke, shapes="toy shapes on CPU (smoke run): figures prove the parts run, nothing more"
                   if smoke else "8B-shaped draft, K = 8, r = 0.7, r_min = 0.2 (issue 24)",
                   null_reasons={k: v for k, v in s.reasons.items() if summary.get(k) is None},
                   parts=s.status, suite_seconds=suite_seconds)
    return summary


def print_table(summary: dict[str, Any]) -> None:
    rows = [(key, summary[key]) for key in KEYS] + [(k, summary[k]) for k in summary if k.startswith("peagle_over")]
    rows += [(f"attention[{name}]", v.get("fwd_bwd_ms") or v.get("fwd_ms") or v.get("status"))
             for name, v in summary["attention"]["variants"].items()]
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
