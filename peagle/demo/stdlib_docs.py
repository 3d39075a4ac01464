"""The demo corpus's raw material: each listed stdlib module's own classes and functions with their
docstrings, collected in a fresh interpreter.

Why a fresh one: what a module holds changes as a process runs (importing torch replaces
``inspect.getfile``; ``tempfile.gettempdir()`` sets ``tempfile.tempdir``), and the demo's chats, so
the target trained on them and the demo's store, must be the same in every process: ``python -I -S``
imports the stdlib alone, nothing from site-packages and nothing the caller imported before. This
file imports the stdlib only, so it runs there as a script.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path


def collect(module_names: list[str]) -> list[list[str]]:
    """``[module, name, docstring]`` for every public class and function defined in each module
    (sorted by name; a docstring of under 40 characters is too little to answer with)."""
    found = []
    for mod_name in module_names:
        try:
            module = importlib.import_module(mod_name)
        except Exception:  # a module missing from this Python build is simply not used
            continue
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if getattr(obj, "__module__", None) != mod_name:  # re-exported or patched in from elsewhere
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 40:
                found.append([mod_name, attr, doc])
    return found


def stdlib_docs(module_names: tuple[str, ...]) -> list[list[str]]:
    """:func:`collect` run in an isolated interpreter (module docstring)."""
    proc = subprocess.run([sys.executable, "-I", "-S", str(Path(__file__).resolve()), *module_names],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


if __name__ == "__main__":
    json.dump(collect(sys.argv[1:]), sys.stdout)
