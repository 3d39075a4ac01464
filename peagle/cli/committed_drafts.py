"""The drafts committed to this repository (benchmarks/results/cpu/drafts/NAME/): the one place that
knows where they are and how to pick one.

Each is an export written without the target's embedding (``peagle export RUN --out DIR
--without-target-embedding --max-file-mib 15``: no file over 16 MiB, so git holds it; a draft of
more layers is in shards) and a ``draft.json`` saying what
it is: the target it was trained for (a name ``peagle target fetch`` knows), the method, the K it was
trained and measured at (``num_depths``), the K to serve it at (``serve_k``: the one ``peagle eval``
recommended for it and serving confirmed; ``num_depths`` when absent), what it measured and the
commands that made it. ``peagle export DIR --target T --out
EXPORT`` makes it whole again; ``peagle demo`` serves the best one for its target and method beside
the draft it trains, so a newcomer sees what a longer training buys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle.schemas.errors import UserError

DRAFT_FILE = "draft.json"
"""What a committed draft is (module docstring)."""


def committed_drafts_dir() -> Path:
    """benchmarks/results/cpu/drafts/ of the checkout this peagle runs from (absent in an installed wheel)."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu" / "drafts"


@dataclass(frozen=True)
class CommittedDraft:
    path: Path
    target: str
    method: str
    num_depths: int
    serve_k: int
    acceptance_length: float
    facts: dict[str, Any]


def read_committed(path: Path) -> CommittedDraft:
    """One committed draft's ``draft.json``, its fields checked.

    Raises:
        UserError: one line naming the file and the field.
    """
    file = path / DRAFT_FILE
    try:
        facts = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{file}: not a committed draft's description ({err})") from err
    fields = {"target": str, "method": str, "num_depths": int, "acceptance_length": (int, float)}
    for name, kind in fields.items():
        if not isinstance(facts.get(name) if isinstance(facts, dict) else None, kind):
            raise UserError(f"{file}: {name} is missing or not a {getattr(kind, '__name__', 'number')}")
    serve_k = facts.get("serve_k", facts["num_depths"])
    if isinstance(serve_k, bool) or not isinstance(serve_k, int) or not 1 <= serve_k <= facts["num_depths"]:
        raise UserError(f"{file}: serve_k must be a K from 1 to num_depths ({facts['num_depths']}), not {serve_k!r}")
    return CommittedDraft(path=path, target=facts["target"], method=facts["method"], num_depths=facts["num_depths"],
                          serve_k=serve_k, acceptance_length=float(facts["acceptance_length"]), facts=facts)


def best_committed(target: str, method: str, root: Path | None = None) -> CommittedDraft | None:
    """The committed draft for ``target`` and ``method`` that measured the highest acceptance length
    (None when there is none here)."""
    root = committed_drafts_dir() if root is None else root
    found = [read_committed(file.parent) for file in sorted(root.glob(f"*/{DRAFT_FILE}"))]
    fitting = [d for d in found if d.target == target and d.method == method]
    return max(fitting, key=lambda d: d.acceptance_length, default=None)
