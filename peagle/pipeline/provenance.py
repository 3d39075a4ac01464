"""Where a trained draft came from: the peagle source and the machine that trained it.

Training records this in every checkpoint (``config.pt``, key ``provenance``) and export copies
it into the export's ``peagle`` section, so an export names the revision that *trained* it, not the
one that happened to export it.
"""

from __future__ import annotations

import contextlib
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import peagle


def git_revision() -> str | None:
    """The git commit of the peagle source tree when it is a checkout (with ``-dirty`` when it has
    uncommitted changes); None for an installed package."""
    root = Path(peagle.__file__).parent
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return done.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    return None


def host_facts() -> dict[str, Any]:
    """The machine and software a run used (what explains a numeric difference between two runs)."""
    import torch

    # Plain str only: checkpoints are read back with weights-only unpickling (torch.__version__ is a
    # TorchVersion, which that refuses).
    facts: dict[str, Any] = {
        "hostname": socket.gethostname(), "platform": platform.platform(), "python": sys.version.split()[0],
        "torch": str(torch.__version__), "cuda": None if torch.version.cuda is None else str(torch.version.cuda),
    }
    if torch.cuda.is_available():
        facts["devices"] = [str(torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]
    return facts


def provenance() -> dict[str, Any]:
    """peagle version, git revision (when run from a checkout) and host facts of this process."""
    return {"peagle_version": peagle.__version__, "git_revision": git_revision(), "host": host_facts()}
