"""One owner per run directory, through the real CLI (docs/reliability.md, "One owner, finite weights"):
while one `peagle train` runs, a second into the same --out is refused in one line naming the first's
pid and host, and changes nothing; once the first is killed with SIGKILL the lock is gone with it, and
the same command resumes from the first's checkpoint."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from faultkit import killed, ok, one_line_error
from peagle.pipeline.checkpoint_files import checkpoint_step, latest_valid_checkpoint

AREA = "train"
LONG = 100_000  # steps: the first run is still training when it is killed


def with_max_steps(args: list[str], steps: int) -> list[str]:
    args = list(args)
    args[args.index("--max-steps") + 1] = str(steps)
    return args


def wait_for(condition, what: str, job, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.running, f"the first run ended before {what}:\n{job.wait(5).describe()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.2)


def lock_holder(run: Path) -> int | None:
    try:
        return json.loads((run / ".lock").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_a_second_run_is_refused_and_a_killed_owner_resumes(train_baseline, runner, tmp_path, figures):
    """A second `peagle train` into a running one's --out: exit 2, one line naming the pid and host, the
    directory untouched. After kill -9 of the first, the same command resumes from its checkpoint."""
    run = tmp_path / "run"
    args = with_max_steps(train_baseline.args(run), LONG)
    first = runner.start(*args)
    figures.add(trials=2, faults_injected=2)
    try:
        wait_for(lambda: lock_holder(run) == first.pid, "lock file naming the first run", first)
        wait_for(lambda: latest_valid_checkpoint(run) is not None, "checkpoint", first)
        second = runner.run(*args, timeout=120)
        error = one_line_error(second, f"{run} is in use by another `peagle train` (pid {first.pid} on "
                                       f"{socket.gethostname()})")
        assert second.stderr.strip() == error, second.describe()  # refused before it read or wrote anything
        assert first.running and lock_holder(run) == first.pid
        figures.add(faults_survived=1)
    finally:
        first.kill()
    killed(first.wait(60))
    resume_from = latest_valid_checkpoint(run)
    step = checkpoint_step(resume_from)
    res = ok(runner.run(*with_max_steps(args, step + 2)))
    assert f"resumed from {resume_from}" in res.stderr, res.describe()
    assert checkpoint_step(latest_valid_checkpoint(run)) == step + 2
    assert lock_holder(run) not in (None, first.pid)  # the resumed run took the lock, and let it go at its end
    figures.add(faults_survived=1)
