"""Loading a benchmark script (benchmarks/*.py, not a package) as a module for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@contextlib.contextmanager
def _loaded(script: str) -> Iterator[ModuleType]:
    """``benchmarks/<script>`` as a module, with its folder on sys.path while it is loaded (scripts
    import their neighbours, e.g. quality_variants) and registered in sys.modules (dataclasses resolve
    their module's annotations through it); both undone afterwards."""
    sys.path.insert(0, str(BENCHMARKS))
    name = f"{Path(script).stem}_benchmark"
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="session")
def load_benchmark():
    """``with load_benchmark("quality.py") as bench: ...``"""
    return _loaded
