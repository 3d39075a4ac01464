"""``RUN_DIR/metrics.jsonl``: one JSON line per logged step and per evaluation, written by rank 0.

A resumed run first drops the lines past its checkpoint's step (the killed run wrote them; this run
writes them again), so the file of a killed-and-resumed run equals that of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from peagle.pipeline.atomic import atomic_write_bytes
from peagle.pipeline.contained import inside
from peagle.schemas.run_files import METRICS_FILE


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    with open(inside(run_dir, METRICS_FILE, tree="run"), "a") as f:  # a link out of the run is refused
        f.write(json.dumps(record) + "\n")


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics lines past ``step``."""
    truncate_jsonl(inside(run_dir, METRICS_FILE, tree="run"), step)


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the lines of a per-step JSON-lines file (metrics, bad steps) past ``step``."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
    atomic_write_bytes(path, "".join(kept).encode())
