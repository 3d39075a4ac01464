"""Print pip constraints for installing peagle into a GPU base image (docker/extract.Dockerfile,
docker/train.Dockerfile): every distribution the image already has at the version it has, and the
lock's version (locks/base.txt) of everything else.

    python3 constraints.py base.txt > /tmp/constraints.txt
    pip install -c /tmp/constraints.txt peagle-*.whl

Why: the image's torch, transformers and vLLM are CUDA builds tested together by their makers, so
none of them may move; what peagle adds on top comes at the versions our test suite passed with, not
whatever the index serves on the day. A conflict between the two is then pip's one-line error at
build time. Standard library only: it runs in the base image's Python before anything is installed.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata


def canonical(name: str) -> str:
    """PEP 503 name: what pip compares."""
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints(lock_lines: list[str], installed: dict[str, str]) -> list[str]:
    """``name==version`` lines: ``installed`` (canonical name -> version) wins over the lock."""
    pins = dict(installed)
    for line in lock_lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins.setdefault(canonical(name), version.strip())
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def main(lock: str) -> None:
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    with open(lock, encoding="utf-8") as f:
        print("\n".join(constraints(f.read().splitlines(), installed)))


if __name__ == "__main__":
    main(sys.argv[1])
