"""Named failpoints for fault tests (docs/reliability.md): the process SIGKILLs itself at a named phase.

``PEAGLE_FAILPOINT=name`` kills at the first hit of ``failpoint("name")``; ``name:N`` at the N-th
hit (1-based). Unset, a failpoint is one dict lookup: cheap enough to leave in hot loops.
Names in use: extract.forward, extract.write, extract.before_commit, extract.after_commit,
train.step, train.checkpoint_write, train.before_checkpoint_rename, train.after_checkpoint_rename,
export.write, dir.before_publish, dir.after_publish, dir.between_renames, store.before_settings,
store.after_settings (docs/reliability.md says where each is and what a kill there leaves).

``PEAGLE_FAILPOINT_HOLD=PATH``: the hit holds the process (polling) while PATH exists, then lets it go
on, instead of killing it. What a scheduler does to a job mid-run (a Slurm requeue, a pod eviction)
is then done to a process known to be at that point (tests/test_slurm.py).
"""

from __future__ import annotations

import os
import signal
import time

_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    spec = os.environ.get("PEAGLE_FAILPOINT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] < int(nth or 1):
        return
    hold = os.environ.get("PEAGLE_FAILPOINT_HOLD")
    if not hold:
        os.kill(os.getpid(), signal.SIGKILL)
    while os.path.exists(hold):
        time.sleep(0.05)
