"""peagle/testing/warm_cli.py: a command forked from the warm server answers as the console script
does (differential: the same argv, environment and working directory, warm and cold) and sees the
caller's environment as it is at the call, not as it was when the server started. (That a child
dies of SIGKILL like any process is the fault suite's daily bread: tests/faults kills hundreds.)"""

from __future__ import annotations

import pytest

from peagle.testing.warm_cli import Runner


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    warm, cold = (Runner(tmp_path_factory.mktemp(name), cold=name == "cold") for name in ("warm", "cold"))
    yield warm, cold
    warm.close()
    cold.close()


@pytest.mark.parametrize("args", [("store", "--help"), ("store", "info", "--store", "no-such-store"),
                                  ("no-such-command",)])
def test_warm_and_cold_give_the_same_answer(runners, args, tmp_path) -> None:
    warm, cold = (r.run(*args, cwd=tmp_path) for r in runners)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm.returncode == (0 if "--help" in args else 2)


def test_a_child_sees_the_environment_of_the_call(runners, monkeypatch) -> None:
    warm, _ = runners
    warm.run("--version")  # the server is up before the environment changes
    monkeypatch.setenv("COLUMNS", "60")  # --help is laid out to $COLUMNS
    narrow = warm.run("store", "--help").stdout
    wide = warm.run("store", "--help", env={"COLUMNS": "200"}).stdout
    assert max(map(len, narrow.splitlines())) <= 60 < max(map(len, wide.splitlines()))
