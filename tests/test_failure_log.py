"""The failure log of tests/conftest.py: a failing test's traceback is on disk as soon as it fails,
so a pytest stopped at a time limit (benchmarks/gpu_suite.sh's cuda_tests) still says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_a_failing_test_is_logged_with_its_traceback_and_a_passing_one_is_not(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_two.py").write_text(
        "def test_passes():\n    assert True\n\n\n"
        "def test_fails():\n    answer = 41\n    assert answer == 42, 'off by one'\n")
    log = tmp_path / "failures.txt"
    env = {**os.environ, "PEAGLE_TEST_FAILURE_LOG": str(log)}  # the name gpu_suite.sh sets
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_two.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    text = log.read_text()
    assert text.count("=== ") == 1 and "=== test_two.py::test_fails (call)" in text
    assert "off by one" in text and "assert 41 == 42" in text
