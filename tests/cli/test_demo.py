"""`peagle demo` checks every option before it starts (issue 22): a typo is one line, and nothing ran."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("args,needle", [
    (("--eval-modes", "offline,onlin"), "--eval-modes takes a comma list of offline,online,vllm, got 'offline,onlin'"),
    (("--hidden-dtype", "int8"), "--hidden-dtype must be one of bf16 (bfloat16), fp8 (float8), got 'int8'"),
    (("--num-depths", "0"), "--num-depths must be >= 1, got 0"),
    (("--train-steps", "-3"), "--train-steps must be >= 1, got -3"),
    (("--seed", "-1"), "--seed must be >= 0, got -1"),
    (("--method", "medusa"), "--method must be one of peagle|eagle3, got 'medusa'"),
])
def test_a_bad_option_is_refused_before_anything_runs(args, needle, tmp_path, run_peagle):
    out, cache = tmp_path / "demo", tmp_path / "cache"
    proc = run_peagle("demo", "--out", out, "--cache-dir", cache, *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.strip() == f"peagle: error: {needle}"
    assert not out.exists() and not cache.exists()
