"""benchmarks/gpu_suite.sh: its CPU smoke run (every part at toy shapes) and its summary's rules.

The smoke run is the suite's GPU command exercised end to end, so it cannot rot between GPU runs:
the same script, the same parts (train_step.py with an fp8 configuration, attention.py, train_run.py
with a real `peagle train`, extract_throughput.py, gpu_summary.py), toy shapes on CPU, CUDA-only
parts null with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.sh"
COMMITTED = REPO / "benchmarks" / "results" / "gpu"
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_summary import KEYS, build_summary  # noqa: E402


def run_suite(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(["bash", str(SUITE), *args], capture_output=True, text=True, env=env, timeout=timeout)


def snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")} if folder.exists() else {}


@pytest.mark.slow
def test_smoke_run_writes_every_key_and_never_touches_the_committed_results(tmp_path):
    before = snapshot(COMMITTED)
    out = tmp_path / "out"
    proc = run_suite("--smoke", "--out", str(out), "--work", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(KEYS) <= set(summary) and summary["smoke"] is True
    numbers = ("peagle_tok_s_1layer_L8192", "peagle_tok_s_4layer_L8192", "matmul_tflops_1layer_L8192",
               "peagle_peak_gib_4layer_L8192", "fp8_tok_s_4layer_L8192", "attention_fwd_bwd_ms_auto",
               "longest_context_4layer", "longest_context_4layer_peak_gib", "longest_context_4layer_step_s",
               "first_step_s", "startup_s", "data_wait_share", "extract_vs_prefill")
    if importlib.util.find_spec("torchao") is None:  # fp8 is an optional extra: absent, its figure is null with a reason
        numbers = tuple(k for k in numbers if k != "fp8_tok_s_4layer_L8192")
        assert summary["fp8_tok_s_4layer_L8192"] is None and summary["null_reasons"]["fp8_tok_s_4layer_L8192"]
    for key in numbers:
        assert isinstance(summary[key], (int, float)) and summary[key] >= 0, (key, summary["null_reasons"])
    assert summary["recompiles_after_warmup"] == 0 and summary["longest_context_4layer"] == 512  # the longest first
    variants = summary["attention"]["variants"]
    assert variants["pad128-static"]["max_rel_diff_vs_auto"] < 1e-3 and variants["flash"]["status"] == "unavailable"
    assert summary["attention_best_variant"] in variants
    assert summary["device"].startswith("cpu") and summary["torch"] and summary["date"]
    # CUDA-only and absent parts: null, each with its reason.
    for key in ("cuda_tests", "speculators_tok_s_1layer_L8192", "speculators_tok_s_4layer_L8192",
                "speculators_attention_fwd_bwd_ms"):
        assert summary[key] is None and summary["null_reasons"][key]
    assert "CUDA-only" in summary["null_reasons"]["cuda_tests"]
    assert "no --speculators-anchor" in summary["null_reasons"]["speculators_tok_s_1layer_L8192"]
    assert all(v is None for v in summary["goals"].values())  # toy figures judge no goal
    parts = {p.name for p in (out / "parts").iterdir()}
    assert {"env.json", "train_step.jsonl", "attention.jsonl", "train_run.json", "extract.json",
            "longest_context.jsonl"} <= parts
    run = json.loads((out / "parts" / "train_run.json").read_text())
    assert run["steps"] == 12 and run["distinct_lengths"] > 10 and run["returncode"] == 0 and not run["killed"]
    assert "key" in proc.stdout and "first_step_s" in proc.stdout  # the table
    assert "step 12: " in proc.stdout  # the run's steps, shown as they came
    # The parts are run in the order, and their budgets add up to the suite's.
    order = [line.split()[1].rstrip(":") for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert order == ["train_step", "speculators", "attention", "train_run", "cuda_tests", "longest_context", "extract"]
    assert snapshot(COMMITTED) == before


def test_usage_errors_and_the_committed_results_are_refused(tmp_path):
    proc = run_suite("--smoke", "--out", str(COMMITTED / "sub"), timeout=60)
    assert proc.returncode == 2 and "never writes over the committed GPU results" in proc.stderr
    proc = run_suite("--frobnicate", timeout=60)
    assert proc.returncode == 2 and "unknown option --frobnicate" in proc.stderr
    proc = run_suite("--parts", "train_step warp", timeout=60)
    assert proc.returncode == 2 and "unknown part warp" in proc.stderr
    proc = run_suite("--speculators-anchor", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "has no bench.py" in proc.stderr
    assert "--speculators-anchor DIR" in run_suite("--help", timeout=60).stdout


def _write(parts: Path, name: str, records) -> None:
    text = "\n".join(json.dumps(r) for r in records) if isinstance(records, list) else json.dumps(records)
    (parts / name).write_text(text + "\n")


def _status(parts: Path, name: str, status: str, reason: str = "") -> None:
    _write(parts, f"{name}.status.json", {"part": name, "status": status, "seconds": 1, "budget_s": 100,
                                          "reason": reason, "finished": "2026-11-23T00:00:00Z"})


def test_summary_of_a_gpu_run_with_an_oom_a_timeout_and_failing_tests(tmp_path):
    """Records shaped like the parts' real output (train_step.py, the anchor's bench.py, junit)."""
    parts = tmp_path / "parts"
    parts.mkdir()
    _write(parts, "env.json", {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-23T00:00:00Z", "torch": "2.11.0+cu130"})
    _write(parts, "train_step.jsonl", [
        {"kind": "env", "torch": "2.11.0+cu130"},
        {"kind": "train_step", "layers": 1, "seq_len": 8192, "status": "ok", "tokens_per_s": 70000.0,
         "matmul_tflops": 420.5, "peak_mem_gib": 20.1},
        {"kind": "train_step", "layers": 4, "seq_len": 8192, "status": "oom", "error": "OutOfMemoryError: CUDA out"},
        {"kind": "train_step", "layers": 4, "seq_len": 8192, "fp8_matmuls": True, "status": "skipped",
         "error": "deadline: 60s spent"}])
    _write(parts, "speculators.jsonl", [
        {"kind": "env"}, {"kind": "model_step", "layers": 1, "seq_len": 8192, "status": "ok", "tokens_per_s": 43100.0},
        {"kind": "model_step", "layers": 4, "seq_len": 8192, "status": "ok", "tokens_per_s": 16700.0}])
    _write(parts, "longest_context.jsonl", [
        {"kind": "train_step", "layers": 4, "seq_len": 131072, "status": "oom", "error": "OutOfMemoryError"},
        {"kind": "train_step", "layers": 4, "seq_len": 65536, "status": "ok", "peak_mem_gib": 51.5,
         "median_ms": 9100.0}])
    _write(parts, "attention.jsonl", [
        {"kind": "attention", "variant": "auto", "status": "ok", "fwd_bwd_ms": 30.1, "fwd_ms": 7.0, "seq_len": 8192,
         "cod_len": 27618},
        {"kind": "attention", "variant": "rows-safe", "status": "ok", "fwd_bwd_ms": 27.9, "fwd_ms": 6.8},
        {"kind": "attention", "variant": "flash", "status": "unavailable", "error": "flash_attn.cute is not installed"}])
    _write(parts, "speculators_attn.jsonl", [
        {"kind": "env"}, {"kind": "attn_baseline", "impl": "flex_attention compiled (...)", "status": "ok",
                          "fwd_bwd_ms": 30.5}])
    _write(parts, "train_run.json", {"steps": 3, "killed": True, "returncode": -15, "first_step_s": 41.0})
    (parts / "cuda_tests.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="1" skipped="0" '
        'tests="5" time="80"></testsuite></testsuites>')
    for name in ("env", "train_step", "speculators", "longest_context"):
        _status(parts, name, "ok")
    _status(parts, "cuda_tests", "error", "exit 1: 1 failed, 4 passed")
    _status(parts, "train_run", "timeout", "ran out of its 55s budget")
    _status(parts, "attention", "ok")
    summary = build_summary(tmp_path, smoke=False, suite_seconds=470)
    assert summary["peagle_tok_s_1layer_L8192"] == 70000.0 and summary["matmul_tflops_1layer_L8192"] == 420.5
    assert summary["peagle_over_speculators_1layer"] == round(70000 / 43100, 3)
    assert summary["peagle_tok_s_4layer_L8192"] is None and summary["slower_than_goal"] == {}
    assert "oom" in summary["null_reasons"]["peagle_tok_s_4layer_L8192"]
    assert summary["fp8_tok_s_4layer_L8192"] is None and "deadline" in summary["null_reasons"]["fp8_tok_s_4layer_L8192"]
    assert (summary["longest_context_4layer"], summary["longest_context_4layer_peak_gib"]) == (65536, 51.5)
    assert summary["longest_context_4layer_step_s"] == 9.1
    assert (summary["attention_fwd_bwd_ms_auto"], summary["attention_best_variant"]) == (30.1, "rows-safe")
    assert summary["speculators_attention_fwd_bwd_ms"] == 30.5
    assert summary["attention"]["variants"]["flash"]["status"] == "unavailable"
    assert summary["cuda_tests"] == {"passed": 4, "failed": 1, "errors": 0, "skipped": 0}
    # A train_run stopped at its limit: the steps it got are reported, the figures it could not get are null.
    assert summary["first_step_s"] == 41.0 and summary["recompiles_after_warmup"] is None
    assert "stopped at the part's limit after 3 step" in summary["null_reasons"]["recompiles_after_warmup"]
    assert "has not run" in summary["null_reasons"]["extract_vs_prefill"]
    goals = summary["goals"]
    assert goals["tok_s_1layer >= 1.5 x speculators"] is True and goals["cuda_tests all pass"] is False
    assert goals["longest_context_4layer >= 131072 within 80 GiB"] is False and goals["first_step_s < 30"] is False


def test_a_slower_step_names_its_top_kernels_and_a_killed_pytest_counts_from_its_logs(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    (tmp_path / "logs").mkdir()
    kernels = [{"name": "triton_tem_fused_flex_attention_backward_1", "ms": 31.4, "share": 0.2, "calls": 1}]
    _write(parts, "train_step.jsonl", [
        {"kind": "train_step", "layers": 4, "seq_len": 8192, "status": "ok", "tokens_per_s": 18000.0,
         "matmul_tflops": 300.0, "peak_mem_gib": 40.0, "top_kernels": kernels}])
    _write(parts, "speculators.jsonl", [{"kind": "model_step", "layers": 4, "seq_len": 8192, "status": "ok",
                                         "tokens_per_s": 17000.0}])
    (tmp_path / "logs" / "cuda_tests.log").write_text(
        "[gw0] [ 10%] PASSED tests/stages/train/test_cuda.py::test_a\n"
        "[gw1] [ 20%] FAILED tests/stages/train/test_cuda.py::test_b\n"
        "tests/stages/train/test_cuda.py::test_c PASSED\n!!!!!!! KeyboardInterrupt !!!!!!!\n")
    (parts / "cuda_tests_failures.txt").write_text(  # what tests/conftest.py logs as a test fails
        "=== tests/stages/train/test_cuda.py::test_b (call)\n[gw1] linux -- Python 3.12\n\n    def test_b():\n"
        ">       assert error < 3e-2\nE       AssertionError: norm.weight: relative gradient difference 0.05\n"
        "E       assert 0.05 < 0.03\n\n")
    for name in ("train_step", "speculators"):
        _status(parts, name, "ok")
    _status(parts, "cuda_tests", "timeout", "ran out of its 45s budget")
    summary = build_summary(tmp_path, smoke=False, suite_seconds=470)
    assert summary["slower_than_goal"] == {"4layer": {"ratio": round(18000 / 17000, 3), "goal": 1.3,
                                                      "top_kernels": kernels}}
    assert summary["cuda_tests"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 0, "from_log": True,
                                     "failures": {"tests/stages/train/test_cuda.py::test_b (call)":
                                                  "AssertionError: norm.weight: relative gradient difference 0.05"}}
    assert summary["goals"]["cuda_tests all pass"] is False


def test_the_gpu_parts_fit_a_lease_as_two_calls():
    """Each call's parts fit its budget, every part but the spare ones is in exactly one call, and the
    two calls with the machine's start (~30-50 s), the wheels' install and the summaries (~10 s each)
    fit the 900 s of a lease, each under the 600 s a device command may run."""
    import re

    text = SUITE.read_text()
    gpu_branch = text[text.index("\nelse\n", text.index("run_part train_step")):]  # after the smoke branch
    parts = {name: int(s) for name, s in re.findall(r"run_part (\w+) (\d+)", gpu_branch)}
    assert list(parts) == ["train_step", "speculators", "attention", "train_run", "cuda_tests", "longest_context",
                           "extract"]
    calls = [(re.search(rf'CALL{n}_PARTS="([^"]+)"', text).group(1).split(),
              int(re.search(rf"CALL{n}_BUDGET=(\d+)", text).group(1))) for n in (1, 2)]
    spare = re.search(r'SPARE_PARTS="([^"]*)"', text).group(1).split()  # measured, run only with --parts
    assert sorted(p for names, _ in calls for p in names) == sorted(["env", *(p for p in parts if p not in spare)])
    for names, budget in calls:
        assert sum(parts.get(p, 0) for p in names) <= budget <= 600 - 30
    assert 50 + sum(budget + 10 for _, budget in calls) <= 900 - 60  # a minute's margin for the gap between calls


def test_a_wheel_too_big_for_one_call_is_staged_then_joined_and_installed_by_the_next(tmp_path):
    """--fa4: call 1 stages the first part of FlashAttention-4's big wheel, call 2 the second, joins it
    (sha256-checked) and installs it with the small wheels it carries (here: a stand-in pure wheel)."""
    import zipfile

    big = tmp_path / "src" / "bigpkg-1.0-py3-none-any.whl"
    big.parent.mkdir()
    with zipfile.ZipFile(big, "w") as zf:  # a real (installable) wheel, made larger than one part
        zf.writestr("bigpkg/__init__.py", "VALUE = 42\n")
        zf.writestr("bigpkg/blob.bin", os.urandom(3 * 2**20))
        zf.writestr("bigpkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: bigpkg\nVersion: 1.0\n")
        zf.writestr("bigpkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("bigpkg-1.0.dist-info/RECORD", "")
    parts = tmp_path / "parts"
    subprocess.run([sys.executable, str(REPO / "scripts" / "payload.py"), "split", str(big), "--out", str(parts),
                    "--part-mib", "2"], check=True, capture_output=True)
    calls = {c: tmp_path / c for c in ("call1", "call2")}
    for i, folder in enumerate(calls.values()):
        folder.mkdir()
        (folder / f"{big.name}.part-00{i}").write_bytes((parts / f"{big.name}.part-00{i}").read_bytes())
        (folder / f"{big.name}.sha256.json").write_bytes((parts / f"{big.name}.sha256.json").read_bytes())
    env = {"PEAGLE_FA4_STAGING": str(tmp_path / "staging"), "PEAGLE_SITE": str(tmp_path / "site")}
    first = run_suite("--parts", "env", "--budget", "30", "--out", str(tmp_path / "out1"), "--fa4", str(calls["call1"]),
                      env=env)
    assert "1 of 2 parts present" in first.stdout and not (tmp_path / "site").exists(), first.stdout + first.stderr
    second = run_suite("--parts", "env", "--budget", "30", "--out", str(tmp_path / "out2"), "--fa4", str(calls["call2"]),
                       env=env)
    assert f"{big.name} joined" in second.stdout, second.stdout + second.stderr
    assert (tmp_path / "site" / "bigpkg" / "__init__.py").read_text() == "VALUE = 42\n"
