"""kill -9 during `peagle extract`, then the same command again: the store must be byte-identical to
an uninterrupted run and pass `peagle store verify` (docs/reliability.md; issue 6).

20 single-worker trials: named failpoints in every phase (mid-forward, mid-write before the rename,
between the rename and the commit record, after the commit record) at several hit counts, and kills
at random moments (delays from a seeded RNG; two kills per trial). Then 2 and 4 concurrent workers
(``--shard-index i --num-shards n``) into one store with kills among them, re-run concurrently. And one
store killed in every phase in turn, each kill hitting the re-run of the one before.
After every kill, before the re-run, the half-done store must already be sound for readers: every
committed shard verifies, no shard is in the manifest without a commit record.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from faultkit import KILLED, Result, diff_snapshots, ok, parallel_map, snapshot, temp_files
from peagle.stages.store.info import verify_store

AREA = "extract"
SEED = 20240611


@dataclass
class Trial:
    name: str
    failpoint: str | None = None  # "name:N", or None for random-moment kills
    delays: tuple[float, ...] = ()  # random kills: seconds after start, one per attempt
    cold: bool = False  # run with the real console script (fresh interpreter) instead of the warm server
    workers: int = 1
    worker_faults: dict[int, str] = field(default_factory=dict)  # worker -> failpoint or "random"


@dataclass
class Outcome:
    trial: str
    injected: int = 0
    survived: int = 0
    data_lost: int = 0
    problems: list[str] = field(default_factory=list)


def build_trials(base) -> list[Trial]:
    """The 20 single-worker trials, from the baseline's counts and a seeded RNG."""
    rng = random.Random(SEED)
    shards = base.manifest["num_shards"]
    forwards = sum(math.ceil(s["num_samples"] / 2) for s in base.manifest["shards"])  # --batch-size 2
    writes = 2 * shards
    picks = {
        "extract.forward": [1, *sorted(rng.sample(range(2, forwards), 2)), forwards],
        "extract.write": [1, 2, rng.randrange(3, writes), writes],
        "extract.before_commit": [1, rng.randrange(2, shards), shards],
        "extract.after_commit": [1, rng.randrange(2, shards), shards],
    }
    trials = [Trial(f"{name}:{n}", failpoint=f"{name}:{n}") for name, ns in picks.items() for n in ns]
    trials[5].cold = True  # one trial through the real console script: same failpoints, same result
    for i in range(20 - len(trials)):
        delays = tuple(round(rng.uniform(0.1, 0.95) * base.wall_s, 3) for _ in range(2))
        trials.append(Trial(f"random-kill-{i}", delays=delays))
    assert len(trials) == 20
    return trials


def check_half_done(store: Path) -> list[str]:
    """What a reader must be able to rely on right after a kill, before any re-run."""
    if not (store / "store.json").exists():
        return []  # killed before the store existed
    problems = []
    num, bad = verify_store(store)
    # Incomplete is what a killed extraction is (verify says so, and exits 1); its files must be intact.
    problems += [f"after the kill: {p}" for p in bad if not p.startswith("incomplete: ")]
    committed = {p.name for p in (store / "commits").glob("[0-9]*.json")}
    manifest = store / "manifest.json"
    if manifest.exists():
        listed = {Path(s["parquet"]).stem + ".json" for s in json.loads(manifest.read_text())["shards"]}
        problems += [f"after the kill: manifest lists {x} with no commit record" for x in sorted(listed - committed)]
    return problems


def lost_samples(base, got: dict[str, str]) -> int:
    """Samples of the baseline whose shard files are missing or different."""
    per_file = base.samples_per_shard()
    shards = set()
    for rel, digest in base.files.items():
        if rel in per_file and got.get(rel) != digest:
            shards.add(Path(rel).stem)
    return sum(s["num_samples"] for s in base.manifest["shards"] if Path(s["parquet"]).stem in shards)


def compare_with_baseline(base, store: Path, runner, outcome: Outcome) -> None:
    got = snapshot(store)
    diffs = diff_snapshots(base.files, got)
    outcome.problems += [f"after the re-run: {d}" for d in diffs]
    outcome.data_lost += lost_samples(base, got)
    verify = runner.run("store", "verify", "--store", store)
    if verify.returncode != 0 or "Traceback" in verify.stderr:
        outcome.problems.append("`peagle store verify` failed:\n" + verify.describe())


def kill_after(job, delay: float) -> Result:
    time.sleep(delay)
    job.kill()
    return job.wait(300)


def run_trial(base, runner, workdir: Path, trial: Trial) -> Outcome:
    store = workdir / trial.name.replace(":", "_") / "store"
    store.parent.mkdir(parents=True)
    outcome = Outcome(trial.name)
    args = base.args(store)
    attempts = [{"PEAGLE_FAILPOINT": trial.failpoint}] if trial.failpoint else [{} for _ in trial.delays]
    for attempt, env in enumerate(attempts):
        job = runner.start(*args, env=env, cold=trial.cold)
        res = kill_after(job, trial.delays[attempt]) if not trial.failpoint else job.wait(300)
        if res.returncode == KILLED:
            outcome.injected += 1
            outcome.problems += check_half_done(store)
        elif trial.failpoint:
            outcome.problems.append(f"failpoint {trial.failpoint} did not kill:\n{res.describe()}")
        elif res.returncode != 0 or "Traceback" in res.stderr:
            outcome.problems.append(f"run {attempt} neither finished nor was killed:\n{res.describe()}")
    rerun = runner.run(*args, cold=trial.cold)
    if rerun.returncode != 0 or "Traceback" in rerun.stderr:
        outcome.problems.append("the re-run failed:\n" + rerun.describe())
    else:
        compare_with_baseline(base, store, runner, outcome)
    if not outcome.problems:
        outcome.survived = outcome.injected
    return outcome


def record(figures, outcomes: list[Outcome]) -> list[str]:
    failures = []
    for o in outcomes:
        figures.add(trials=1, faults_injected=o.injected, faults_survived=o.survived, data_lost=o.data_lost)
        if o.problems:
            failures.append(f"[{o.trial}] " + "\n  ".join(o.problems[:6]))
    figures.notes.append(f"{len(outcomes)} trials: " + ", ".join(f"{o.trial}({o.injected} kill)" for o in outcomes))
    return failures


def test_kill_and_resume_single_worker(extract_baseline, runner, tmp_path, figures):
    """20 kill -9 trials (every failpoint phase, random moments), then the same command: a
    byte-identical store (shards, commit records, manifest) that `peagle store verify` accepts."""
    trials = build_trials(extract_baseline)
    outcomes = parallel_map(lambda t: run_trial(extract_baseline, runner, tmp_path, t), trials)
    failures = record(figures, outcomes)
    random_kills = sum(o.injected for t, o in zip(trials, outcomes) if not t.failpoint)
    assert random_kills >= 1, "no random kill landed: the runs finish before the drawn delays"
    assert not failures, f"{len(failures)} of {len(trials)} trials broke:\n" + "\n".join(failures)


def test_kill_in_every_phase_in_turn_then_resume(extract_baseline, runner, tmp_path, figures):
    """One store killed again and again, each re-run at the next phase of a shard's write: every
    re-run resumes what the kills before it left, and the last one ends with the uninterrupted store."""
    store = tmp_path / "store"
    outcome = Outcome("every-phase-in-turn")
    for failpoint in ("extract.forward:3", "extract.write:2", "extract.before_commit", "extract.after_commit"):
        res = runner.run(*extract_baseline.args(store), env={"PEAGLE_FAILPOINT": failpoint})
        assert res.returncode == KILLED, f"{failpoint} did not kill\n" + res.describe()
        outcome.injected += 1
        outcome.problems += check_half_done(store)
    ok(runner.run(*extract_baseline.args(store)))
    compare_with_baseline(extract_baseline, store, runner, outcome)
    if not outcome.problems:
        outcome.survived = outcome.injected
    failures = record(figures, [outcome])
    assert not failures, "\n".join(failures)


def run_workers(base, runner, store: Path, num: int, faults: dict[int, str],
                rng: random.Random) -> tuple[int, list[str]]:
    """Start ``num`` workers at once, with the given faults; returns (kills landed, problems)."""
    jobs = []
    for i in range(num):
        fault = faults.get(i)
        env = {"PEAGLE_FAILPOINT": fault} if fault and fault != "random" else {}
        jobs.append((i, fault, runner.start(*base.args(store, "--shard-index", str(i), "--num-shards", str(num)),
                                            env=env)))
    kills, problems = 0, []
    for i, fault, job in jobs:
        if fault == "random":
            res = kill_after(job, rng.uniform(0.1, 0.8) * base.wall_s / num)
        else:
            res = job.wait(300)
        if res.returncode == KILLED:
            kills += 1
        elif fault and fault != "random":
            problems.append(f"worker {i}: failpoint {fault} did not kill:\n{res.describe()}")
        elif res.returncode != 0 or "Traceback" in res.stderr:
            problems.append(f"worker {i} failed:\n{res.describe()}")
    return kills, problems


CONCURRENT_TRIALS = [
    (2, {0: "extract.before_commit:2", 1: "random"}),
    (2, {0: "extract.forward:3", 1: "extract.after_commit:4"}),  # worker 1 dies after its last commit record
    (4, {0: "extract.write:3", 1: "extract.before_commit:1", 2: "random"}),
    (4, {0: "random", 1: "random", 2: "extract.after_commit:1", 3: "extract.forward:2"}),
]


def test_kill_and_resume_concurrent_workers(extract_baseline, runner, tmp_path, figures):
    """n workers into one store, some killed; the same n commands again: the one-worker store."""
    rng = random.Random(SEED + 1)
    failures = []
    for t, (num, faults) in enumerate(CONCURRENT_TRIALS):
        store = tmp_path / f"workers{num}-{t}" / "store"
        store.parent.mkdir()
        outcome = Outcome(f"{num}-workers-{t}")
        kills, problems = run_workers(extract_baseline, runner, store, num, faults, rng)
        outcome.injected, outcome.problems = kills, problems
        outcome.problems += check_half_done(store)
        _, problems = run_workers(extract_baseline, runner, store, num, {}, rng)
        outcome.problems += problems
        if not problems:
            compare_with_baseline(extract_baseline, store, runner, outcome)
        if not outcome.problems:
            outcome.survived = outcome.injected
        failures += record(figures, [outcome])
    assert not failures, "\n".join(failures)


def test_kill_leaves_no_temp_files_after_rerun(extract_baseline, runner, tmp_path, figures):
    """A kill mid-write leaves a temp file behind; the re-run removes it (and the store still equals)."""
    store = tmp_path / "store"
    res = runner.run(*extract_baseline.args(store), env={"PEAGLE_FAILPOINT": "extract.write:3"})
    assert res.returncode == KILLED, res.describe()
    left = temp_files(store)
    assert left, "a kill before the rename should leave its temp file (else this test tests nothing)"
    ok(runner.run(*extract_baseline.args(store)))
    assert temp_files(store) == []
    assert diff_snapshots(extract_baseline.files, snapshot(store)) == []
    figures.add(trials=1, faults_injected=1, faults_survived=1)
