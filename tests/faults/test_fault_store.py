"""A damaged shard store is refused before training, in one line, never with a traceback (docs/store.md,
docs/reliability.md; issue 6).

Damage a reader can see from sizes alone (truncated, extended or deleted files, a commit record with
another size, unreadable commit records or settings) must stop `peagle train` before its first step
(fast path, no --verify). Damage that keeps every size (a flipped byte, an edited checksum, a
hand-edited manifest) must be reported by `peagle store verify` (sha256) and stop `peagle train
--verify`. Both commands exit non-zero with a message naming the damaged file.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from faultkit import Result, one_line_error, parallel_map

AREA = "store"
SHARD = "00003"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _set(key: str, value) -> Callable[[dict], None]:
    return lambda d: d.__setitem__(key, value)


def _bump_samples(manifest: dict) -> None:
    manifest["num_samples"] += 1
    manifest["shards"][0]["num_samples"] += 1


@dataclass(frozen=True)
class Damage:
    name: str
    apply: Callable[[Path], None]
    names: str  # what the error must name
    fast: bool  # detectable from sizes (train without --verify must refuse)
    train_reads: bool = True  # train reads this file (the manifest is derived; readers use commit records)


SHARDS = Path("shards")
TENSORS, ROWS = f"{SHARD}.safetensors", f"{SHARD}.parquet"
COMMIT = f"{SHARD}.json"
DAMAGES = [
    Damage("safetensors truncated", lambda s: _truncate(s / SHARDS / TENSORS), TENSORS, True),
    Damage("safetensors emptied", lambda s: _truncate(s / SHARDS / TENSORS, 0), TENSORS, True),
    Damage("safetensors extended", lambda s: (s / SHARDS / TENSORS).open("ab").write(b"\0" * 8), TENSORS, True),
    Damage("parquet truncated", lambda s: _truncate(s / SHARDS / ROWS, 0.9), ROWS, True),
    Damage("safetensors deleted", lambda s: (s / SHARDS / TENSORS).unlink(), TENSORS, True),
    Damage("parquet deleted", lambda s: (s / SHARDS / ROWS).unlink(), ROWS, True),
    Damage("shard directory deleted", lambda s: shutil.rmtree(s / SHARDS), "00000", True),
    Damage("commit record: other size", lambda s: _edit_json(s / "commits" / COMMIT, _set("parquet_bytes", 12)),
           ROWS, True),
    Damage("commit record: truncated", lambda s: _truncate(s / "commits" / COMMIT), COMMIT, True),
    Damage("commit record: field removed",
           lambda s: _edit_json(s / "commits" / COMMIT, lambda d: d.pop("safetensors_sha256")), COMMIT, True),
    Damage("commit record: not an object", lambda s: (s / "commits" / COMMIT).write_text("[1, 2]\n"), COMMIT, True),
    Damage("store.json truncated", lambda s: _truncate(s / "store.json"), "store.json", True),
    Damage("store.json: other schema version", lambda s: _edit_json(s / "store.json", _set("schema_version", 99)),
           "schema_version", True),
    Damage("safetensors byte flipped", lambda s: _flip_byte(s / SHARDS / TENSORS), TENSORS, False),
    Damage("parquet byte flipped", lambda s: _flip_byte(s / SHARDS / ROWS), ROWS, False),
    Damage("commit record: other sha256",
           lambda s: _edit_json(s / "commits" / COMMIT, _set("parquet_sha256", "0" * 64)), ROWS, False),
]
MANIFEST_EDITS = [
    Damage("manifest edited: sample count", lambda s: _edit_json(s / "manifest.json", _bump_samples), "manifest.json",
           False, train_reads=False),
    Damage("manifest edited: shard removed",
           lambda s: _edit_json(s / "manifest.json", lambda d: d["shards"].pop()), "manifest.json", False,
           train_reads=False),
    Damage("manifest truncated", lambda s: _truncate(s / "manifest.json"), "manifest.json", False, train_reads=False),
]


def _clean_failure(res: Result, needle: str, rcs: tuple[int, ...]) -> str | None:
    """None if the command failed as it should (exit in ``rcs``, no traceback, names ``needle``)."""
    if res.returncode not in rcs or "Traceback" in res.stderr or needle not in res.stderr:
        return f"expected exit {rcs} naming {needle!r}, no traceback:\n{res.describe()}"
    return None


def _one_line(res: Result, needle: str) -> str | None:
    try:
        one_line_error(res, needle)
    except AssertionError as err:
        return str(err)
    if "train:" in res.stderr:  # the progress bar: training started
        return f"training started before the damage was found:\n{res.describe()}"
    return None


def test_damaged_store_is_refused(extract_baseline, train_baseline, runner, tmp_path, figures):
    """Each damage is named by `peagle store verify` and stops `peagle train` (size damage without
    --verify, checksum damage with it) in one line, before the first step, without a traceback."""
    def trial(damage: Damage) -> list[str]:
        store = tmp_path / damage.name.replace(" ", "_").replace(":", "")
        shutil.copytree(extract_baseline.store, store)
        damage.apply(store)
        run = store.parent / (store.name + "-run")
        problems = []
        verify = runner.run("store", "verify", "--store", store)
        # Detection: the damaged file named, no traceback. (Its exit status is checked apart, in
        # test_verify_exits_non_zero_on_damage, so that one CLI bug does not hide what is detected.)
        if "Traceback" in verify.stderr or damage.names not in verify.stderr or "verify ok" in verify.stdout:
            problems.append(f"`peagle store verify` did not report it:\n{verify.describe()}")
        if not damage.train_reads:
            return problems
        train_args = list(train_baseline.args(run))
        train_args[train_args.index("--store") + 1] = str(store)
        train = runner.run(*train_args, *(() if damage.fast else ("--verify",)))
        if (p := _one_line(train, damage.names)) is not None:
            problems.append(f"`peagle train{'' if damage.fast else ' --verify'}`: {p}")
        return problems

    results = parallel_map(trial, DAMAGES)
    failures = []
    for damage, problems in zip(DAMAGES, results):
        figures.add(trials=1, faults_injected=1, faults_survived=int(not problems))
        if problems:
            failures.append(f"[{damage.name}] " + "\n  ".join(problems))
    figures.notes.append("damage: " + ", ".join(d.name for d in DAMAGES))
    assert not failures, f"{len(failures)} of {len(DAMAGES)} damages not handled:\n" + "\n".join(failures)


def test_train_without_verify_never_tracebacks_on_flipped_bytes(extract_baseline, train_baseline, runner, tmp_path,
                                                                 figures):
    """`peagle train` without --verify on flipped bytes: a finished run or one clear line, no traceback.

    Without --verify a same-size corruption is not looked for (docs/reliability.md: sizes only); reading it
    must still end either in a finished run or in one clear line."""
    def trial(target: str) -> str | None:
        store = tmp_path / target.replace(".", "_")
        shutil.copytree(extract_baseline.store, store)
        for offset in (0.25, 0.5, 0.75):
            path = store / SHARDS / target
            data = bytearray(path.read_bytes())
            data[int(len(data) * offset)] ^= 0xFF
            path.write_bytes(bytes(data))
        args = list(train_baseline.args(store.parent / (store.name + "-run")))
        args[args.index("--store") + 1] = str(store)
        res = runner.run(*args)
        if "Traceback" in res.stderr or res.returncode not in (0, 2):
            return res.describe()
        return None

    targets = [f"{SHARD}.parquet", f"{SHARD}.safetensors", "00000.parquet"]
    results = parallel_map(trial, targets)
    figures.add(trials=len(targets), faults_injected=len(targets),
                faults_survived=sum(r is None for r in results))
    bad = [f"[{t}] {r}" for t, r in zip(targets, results) if r]
    assert not bad, "\n".join(bad)


def _verify_damaged(extract_baseline, runner, root: Path, damage: Damage) -> Result:
    store = root / damage.name.replace(" ", "_").replace(":", "")
    shutil.copytree(extract_baseline.store, store)
    damage.apply(store)
    return runner.run("store", "verify", "--store", store)


def test_verify_exits_non_zero_on_damage(extract_baseline, runner, tmp_path, figures):
    """`peagle store verify` on a damaged store must fail as a command: exit 1, for scripts and CI; a
    flipped byte is reported as the file whose sha256 does not match, with the count of problems."""
    picked = [d for d in DAMAGES if d.name in ("safetensors byte flipped", "parquet truncated", "safetensors deleted")]
    results = parallel_map(lambda d: _verify_damaged(extract_baseline, runner, tmp_path, d), picked)
    figures.add(trials=len(picked), faults_injected=len(picked),
                faults_survived=sum(r.returncode == 1 for r in results))
    bad = [f"[{d.name}] {r.describe()}" for d, r in zip(picked, results) if r.returncode != 1]
    assert not bad, "verify printed FAILED but exited with status 0:\n" + "\n".join(bad)
    flipped = next(r for d, r in zip(picked, results) if d.name == "safetensors byte flipped")
    assert "Traceback" not in flipped.stderr, flipped.describe()
    assert f"{SHARDS / TENSORS} sha256 does not match its commit record" in flipped.stderr, flipped.describe()
    assert f"verify FAILED: 1 problem(s) in {extract_baseline.manifest['num_shards']} committed shards" in \
        flipped.stderr, flipped.describe()


def test_verify_detects_hand_edited_manifest(extract_baseline, runner, tmp_path, figures):
    """A hand-edited or truncated manifest.json is reported by `peagle store verify`.

    manifest.json is derived from the commit records (docs/store.md); issue 6 lists 'manifest edited by
    hand' among the damages verify must find."""
    results = parallel_map(lambda d: _verify_damaged(extract_baseline, runner, tmp_path, d), MANIFEST_EDITS)
    found = [r.returncode != 0 and "manifest.json" in r.stderr and "Traceback" not in r.stderr for r in results]
    figures.add(trials=len(results), faults_injected=len(results), faults_survived=sum(found))
    bad = [f"[{d.name}] {r.describe()}" for d, r, f in zip(MANIFEST_EDITS, results, found) if not f]
    assert not bad, "\n".join(bad)
