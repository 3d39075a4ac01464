"""kill -9 during `peagle train`, then the same command again: the same per-step losses and the same
final weights as an uninterrupted run, on CPU (docs/reliability.md; issue 6). A damaged newest checkpoint is
detected, warned about on stderr, and the one before it is used.

Kills: ``train.step:N`` at seeded steps, inside a checkpoint's part writes
(``train.checkpoint_write:N``: between writing a part and its fsync), after the checkpoint's files
and metadata but before the directory rename (``train.before_checkpoint_rename:N``), at random
moments, twice in one trial, with DataLoader workers, and once through the real console script.
After every kill, before the resume, every visible ``step-N`` directory must be a whole checkpoint.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from faultkit import KILLED, SAVE_EVERY, TRAIN_STEPS, compare_run, ok, parallel_map
from peagle.stages.train.checkpoint import PER_RANK_PARTS, SHARED_PARTS, checkpoint_problem, list_checkpoints

AREA = "train"
SEED = 977
NUM_CHECKPOINTS = TRAIN_STEPS // SAVE_EVERY
PARTS_PER_CHECKPOINT = len(SHARED_PARTS) + len(PER_RANK_PARTS)


@dataclass
class Trial:
    name: str
    failpoints: tuple[str | None, ...] = ()  # one per killed attempt; None = random moment
    delays: tuple[float, ...] = ()
    extra: tuple[str, ...] = ()
    cold: bool = False


@dataclass
class Outcome:
    trial: str
    injected: int = 0
    survived: int = 0
    steps_lost: int = 0
    problems: list[str] = field(default_factory=list)


def build_trials(base) -> list[Trial]:
    rng = random.Random(SEED)
    writes = NUM_CHECKPOINTS * PARTS_PER_CHECKPOINT
    trials = [Trial(f"train.step:{n}", (f"train.step:{n}",)) for n in
              (1, SAVE_EVERY + 1, rng.randrange(4, TRAIN_STEPS), TRAIN_STEPS)]
    trials += [Trial(f"train.checkpoint_write:{n}", (f"train.checkpoint_write:{n}",)) for n in
               (1, PARTS_PER_CHECKPOINT, rng.randrange(PARTS_PER_CHECKPOINT + 1, writes), writes)]
    trials += [Trial(f"train.before_checkpoint_rename:{n}", (f"train.before_checkpoint_rename:{n}",)) for n in
               (1, rng.randrange(2, NUM_CHECKPOINTS), NUM_CHECKPOINTS)]
    trials.append(Trial("twice", ("train.step:5", "train.checkpoint_write:3")))
    trials.append(Trial("loader-workers", ("train.step:6",), extra=("--num-workers", "1")))
    trials.append(Trial("cold-console-script", ("train.step:4",), cold=True))
    for i in range(3):
        trials.append(Trial(f"random-kill-{i}", (None, None),
                            delays=tuple(round(rng.uniform(0.2, 0.95) * base.wall_s, 3) for _ in range(2))))
    return trials


def visible_checkpoint_problems(run: Path) -> list[str]:
    return [f"{p.name} is visible but damaged: {problem}" for p in list_checkpoints(run)
            if (problem := checkpoint_problem(p)) is not None]


def run_trial(base, runner, workdir: Path, trial: Trial) -> Outcome:
    run = workdir / trial.name.replace(":", "_")
    outcome = Outcome(trial.name)
    args = base.args(run, *trial.extra)
    for attempt, failpoint in enumerate(trial.failpoints):
        env = {"PEAGLE_FAILPOINT": failpoint} if failpoint else {}
        job = runner.start(*args, env=env, cold=trial.cold)
        if failpoint is None:
            time.sleep(trial.delays[attempt])
            job.kill()
        res = job.wait(300)
        if res.returncode == KILLED:
            outcome.injected += 1
            outcome.problems += visible_checkpoint_problems(run)
        elif failpoint is not None:
            outcome.problems.append(f"failpoint {failpoint} did not kill:\n{res.describe()}")
        elif res.returncode != 0 or "Traceback" in res.stderr:
            outcome.problems.append(f"attempt {attempt} neither finished nor was killed:\n{res.describe()}")
    resumed = runner.run(*args, cold=trial.cold)
    if resumed.returncode != 0 or "Traceback" in resumed.stderr:
        outcome.problems.append("the resume failed:\n" + resumed.describe())
        outcome.steps_lost = TRAIN_STEPS
    else:
        problems, outcome.steps_lost = compare_run(base, run)
        outcome.problems += problems
    if not outcome.problems:
        outcome.survived = outcome.injected
    return outcome


def record(figures, outcomes) -> list[str]:
    failures = []
    for o in outcomes:
        figures.add(trials=1, faults_injected=o.injected, faults_survived=o.survived, data_lost=o.steps_lost)
        if o.problems:
            failures.append(f"[{o.trial}] " + "\n  ".join(o.problems[:6]))
    figures.notes.append("data_lost counts training steps whose metrics differ from the uninterrupted run")
    return failures


def test_kill_and_resume(train_baseline, runner, tmp_path, figures):
    """kill -9 at steps, inside checkpoint writes and at random moments, then the same command:
    identical per-step metrics and identical final weights, optimizer, scheduler and data state."""
    trials = build_trials(train_baseline)
    outcomes = parallel_map(lambda t: run_trial(train_baseline, runner, tmp_path, t), trials)
    failures = record(figures, outcomes)
    random_kills = sum(o.injected for t, o in zip(trials, outcomes) if None in t.failpoints)
    assert random_kills >= 1, "no random kill landed: the runs finish before the drawn delays"
    assert not failures, f"{len(failures)} of {len(trials)} trials broke:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------------------------
# A damaged newest checkpoint


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {
    "model-byte-flipped": lambda ckpt: _flip_byte(ckpt / "model.pt"),
    "optimizer-truncated": lambda ckpt: _truncate(ckpt / "optimizer.pt"),
    "dataloader-emptied": lambda ckpt: _truncate(ckpt / "dataloader.pt", 0.0),
    "rng-deleted": lambda ckpt: (ckpt / "rng.pt").unlink(),
    "metadata-deleted": lambda ckpt: (ckpt / "metadata.json").unlink(),
    "metadata-truncated": lambda ckpt: _truncate(ckpt / "metadata.json"),
}


@dataclass(frozen=True)
class KilledRun:
    run: Path
    newest: str
    previous: str


def killed_run(base, runner, run: Path) -> KilledRun:
    """A run killed at step 9: checkpoints of steps 6 and 8 are on disk (--keep-checkpoints 2)."""
    res = runner.run(*base.args(run), env={"PEAGLE_FAILPOINT": f"train.step:{TRAIN_STEPS - 1}"})
    assert res.returncode == KILLED, res.describe()
    names = [p.name for p in list_checkpoints(run)]
    assert names == [f"step-{TRAIN_STEPS - 4:08d}", f"step-{TRAIN_STEPS - 2:08d}"], names
    return KilledRun(run, names[-1], names[-2])


def test_damaged_latest_checkpoint_falls_back_with_a_warning(train_baseline, runner, tmp_path, figures):
    """A flipped, truncated, emptied or missing file in the newest checkpoint: one warning, resume from
    the one before it, and the uninterrupted run's result."""
    def trial(name: str) -> Outcome:
        run = tmp_path / name  # its own killed run: --out is part of the run's identity
        killed = killed_run(train_baseline, runner, run)
        DAMAGE[name](run / "checkpoints" / killed.newest)
        outcome = Outcome(name, injected=1)
        res = runner.run(*train_baseline.args(run))
        if res.returncode != 0 or "Traceback" in res.stderr:
            outcome.problems.append("the resume failed:\n" + res.describe())
            outcome.steps_lost = TRAIN_STEPS
            return outcome
        warnings = [line for line in res.stderr.splitlines() if "warning" in line and killed.newest in line]
        if len(warnings) != 1 or "damaged" not in warnings[0]:
            outcome.problems.append("no one-line warning naming the damaged checkpoint:\n" + res.describe())
        if f"resumed from {run / 'checkpoints' / killed.previous}" not in res.stderr:
            outcome.problems.append(f"did not resume from {killed.previous}:\n" + res.describe())
        problems, outcome.steps_lost = compare_run(train_baseline, run)
        outcome.problems += problems
        outcome.survived = int(not outcome.problems)
        return outcome

    outcomes = parallel_map(trial, list(DAMAGE))
    failures = record(figures, outcomes)
    assert not failures, "\n".join(failures)


def test_every_checkpoint_damaged_starts_over(train_baseline, runner, tmp_path, figures):
    """Both checkpoints damaged: two warnings, training restarts from step 0, same result."""
    killed = killed_run(train_baseline, runner, tmp_path / "run")
    for name in (killed.newest, killed.previous):
        _flip_byte(killed.run / "checkpoints" / name / "optimizer.pt")
    res = ok(runner.run(*train_baseline.args(killed.run)))
    warned = [line for line in res.stderr.splitlines() if "warning" in line and "damaged" in line]
    assert len(warned) == 2, res.describe()
    assert "resumed from" not in res.stderr, res.describe()
    problems, lost = compare_run(train_baseline, killed.run)
    figures.add(trials=1, faults_injected=2, faults_survived=2 * (not problems), data_lost=lost)
    assert not problems, problems


def test_resume_restores_the_global_torch_rng(train_baseline, runner, tmp_path, figures):
    """After kill -9 and resume, the global torch RNG state equals the uninterrupted run's (docs/reliability.md).

    The checkpoint's torch RNG state is restored on resume; the final state must then equal the
    baseline's (nothing else in a run is random in a process-dependent way)."""
    run = tmp_path / "run"
    res = runner.run(*train_baseline.args(run), env={"PEAGLE_FAILPOINT": f"train.step:{SAVE_EVERY * 2 + 1}"})
    assert res.returncode == KILLED, res.describe()
    ok(runner.run(*train_baseline.args(run)))
    final = run / "checkpoints" / train_baseline.final.name
    got = torch.load(final / "rng.pt", weights_only=True)["rank_0"]["torch"]
    want = torch.load(train_baseline.final / "rng.pt", weights_only=True)["rank_0"]["torch"]
    same = torch.equal(got, want)
    figures.add(trials=1, faults_injected=1, faults_survived=int(same))
    if not same:
        figures.notes.append("resumed run ends with another global torch RNG state than the uninterrupted run")
    assert same, ("the global torch RNG state after kill + resume differs from the uninterrupted run's "
                  "(each new DataLoader iterator draws its base seed from the global generator, and the "
                  "resumed run creates one more iterator than the uninterrupted run did)")
