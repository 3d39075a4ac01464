"""What the ``peagle`` command hides of its libraries' own output unless ``--verbose`` is given.

vLLM logs dozens of INFO lines and warnings per engine start (from three processes), torch and
transformers add warnings and progress bars of their own. Between peagle's lines they bury the few a
user needs. The libraries read these settings from the environment when they are imported, and
vLLM's engine processes inherit the environment, so the command sets them in its own environment
before any stage imports a library. Only the ``peagle`` command does this (``peagle.cli.main``), so
code that calls the stages as a library keeps the libraries' defaults. A variable the user has set
already is left as it is. Errors are never hidden: every setting keeps ERROR level.
"""

from __future__ import annotations

import builtins
import os
import warnings
from collections.abc import MutableMapping

QUIET_ENVIRONMENT = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's INFO/WARNING lines, in every engine process
    "TRANSFORMERS_VERBOSITY": "error",
    "TORCH_LOGS": "-all",  # torch's Python-side warnings ("Triton not available", ...)
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # torch's C++ warnings (NUMA binding, ...)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' loading and saving bars
    "TQDM_DISABLE": "1",  # other libraries' bars; peagle's own (pipeline/progress.py) pass disable=False
}
"""Environment variables set (unless already set) when ``peagle`` runs without ``--verbose``."""

QUIET_WARNINGS = ("ignore::DeprecationWarning", "ignore::FutureWarning",
                  "ignore:resource_tracker:UserWarning")
"""Python warnings filters (``-W`` syntax): notices for library developers, not for our users; the
resource tracker's note about shared memory vLLM's engine leaves behind at exit."""


def quiet_libraries(environ: MutableMapping[str, str] | None = None) -> None:
    """Hide the libraries' logs, warnings and progress bars in this process and its children.

    Only for the ``peagle`` command's own process (``main``): it changes the process environment
    and the warnings filters.
    """
    environ = os.environ if environ is None else environ
    for key, value in QUIET_ENVIRONMENT.items():
        environ.setdefault(key, value)
    if "PYTHONWARNINGS" not in environ:  # children (vLLM's engine processes) read it at start
        environ["PYTHONWARNINGS"] = ",".join(QUIET_WARNINGS)
        for spec in QUIET_WARNINGS:  # this process read it already
            action, message, category = spec.split(":")
            warnings.filterwarnings(action, message=message, category=getattr(builtins, category))
