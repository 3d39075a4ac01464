"""Nothing half-made is trusted (docs/reliability.md, "Nothing half-made is trusted"; issue 46).

Each multi-step write is killed at exact points of the real `peagle` process (named failpoints:
``PEAGLE_FAILPOINT=name:N`` kills it at the N-th hit), and what it left must be either whole or
refused by every reader; the same command run again must clean up what the killed one left (its
hidden working directories, named after the output and the dead pid, nothing else) and end with
the uninterrupted result, byte for byte.

* `peagle export`, fresh and replacing an export: killed after the weights, before the publish, after
  it. `--out` is absent or whole (old or new), never missing once it existed.
* `peagle store convert` and `peagle extract`, killed before and after `store.json` and in a first
  shard's commit: no intermediate state verifies.
* A chat template that fails on every record: the store of empty shards is refused by `verify`, `info`,
  `vocab`, `train` and `store check`, and the mended command starts it afresh.
* A store of an older peagle killed between `store.json` and its plan: not "verify ok".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from faultkit import KILLED, killed, ok, one_line_error, snapshot, temp_files

AREA = "half-made writes"


def dead_pid() -> int:
    """The pid of a process that has ended (what a killed writer's leftovers are named after)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def hidden_beside(path: Path) -> list[str]:
    """Entries beside ``path`` that a writer of ``path`` names (``.NAME.*``)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_a_killed_export_leaves_no_debris_and_never_a_missing_out(train_baseline, runner, tmp_path, figures):
    """`peagle export` killed after writing the weights, before publishing the directory and after it,
    into a new `--out` and over an existing export: `--out` is absent or whole (the old export until the
    new one is in place), and the re-run removes the killed run's hidden directories and writes the
    uninterrupted export byte for byte; leftovers of dead writers of older peagles go too, a live
    writer's and another name's stay."""
    args, old_args = ["export", train_baseline.final], ["--speculative-tokens", "2"]
    ok(runner.run(*args, "--out", tmp_path / "new"))
    ok(runner.run(*args, "--out", tmp_path / "old", *old_args))
    want_new, want_old = snapshot(tmp_path / "new"), snapshot(tmp_path / "old")
    assert want_new != want_old
    points = ("export.write", "dir.before_publish", "dir.after_publish")
    for replacing in (False, True):
        for point in points:
            figures.add(trials=1, faults_injected=1)
            out = tmp_path / f"{'replace' if replacing else 'fresh'}-{point}"
            if replacing:
                ok(runner.run(*args, "--out", out, *old_args))
            killed(runner.run(*args, "--out", out, env={"PEAGLE_FAILPOINT": point}))
            after = point == "dir.after_publish"
            if replacing or after:  # never missing once it existed; the new one once published
                assert snapshot(out) == (want_new if after else want_old), point
            else:
                assert not out.exists(), point
            ok(runner.run(*args, "--out", out))
            assert snapshot(out) == want_new and not hidden_beside(out), (point, hidden_beside(out))
            figures.add(faults_survived=1)

    # leftovers of older peagles' killed exports (the old export renamed away, a half-built one)
    out, dead, live = tmp_path / "replace-dir.after_publish", dead_pid(), os.getpid()
    for name in (f".{out.name}.deleted-{dead}", f".{out.name}.tmp-{dead}-abc123", f".{out.name}.tmp-{live}-keep",
                 f".other.tmp-{dead}-keep"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    figures.add(trials=1, faults_injected=1)
    ok(runner.run(*args, "--out", out))
    assert hidden_beside(out) == [f".{out.name}.tmp-{live}-keep"] and (tmp_path / f".other.tmp-{dead}-keep").is_dir()
    assert snapshot(out) == want_new
    figures.add(faults_survived=1)


def convert_args(store: Path, out: Path) -> list:
    return ["store", "convert", "--store", store, "--hidden-dtype", "fp8", "--out", out]


def not_verified(runner, store: Path, point: str) -> None:
    """`store verify` fails and `store info` does not pass the store off as an old one without a plan."""
    verify = runner.run("store", "verify", "--store", store)
    assert verify.returncode != 0 and "verify ok" not in verify.stdout, f"{point}\n{verify.describe()}"
    assert "Traceback" not in verify.stderr, verify.describe()
    info = runner.run("store", "info", "--store", store)
    assert "from before peagle recorded one" not in info.stdout and "Traceback" not in info.stderr, info.describe()


def test_a_killed_conversion_or_first_extract_leaves_no_store_that_verifies(extract_baseline, runner, tmp_path,
                                                                            figures):
    """`peagle store convert` and a first `peagle extract` killed just before `store.json` is published
    (the plan recorded), just after it, and in the first shard's write and commit: `store verify` never
    says ok and `store info` never calls it a store from before plans; the same command finishes it to
    the uninterrupted store, with no temp file left."""
    want_fp8 = tmp_path / "fp8"
    ok(runner.run(*convert_args(extract_baseline.store, want_fp8)))
    cases = [("convert", point) for point in ("store.before_settings", "store.after_settings", "extract.write:2",
                                             "extract.before_commit:1", "extract.after_commit:1")]
    cases += [("extract", point) for point in ("store.before_settings", "store.after_settings")]
    for verb, point in cases:
        figures.add(trials=1, faults_injected=1)
        out = tmp_path / f"{verb}-{point}"
        command = (convert_args(extract_baseline.store, out) if verb == "convert" else extract_baseline.args(out))
        res = runner.run(*command, env={"PEAGLE_FAILPOINT": point})
        assert res.returncode == KILLED, f"{verb} {point}\n{res.describe()}"
        not_verified(runner, out, f"{verb} {point}")
        ok(runner.run(*command))
        assert snapshot(out) == (snapshot(want_fp8) if verb == "convert" else extract_baseline.files), (verb, point)
        assert not temp_files(out), temp_files(out)
        ok(runner.run("store", "verify", "--store", out))
        figures.add(faults_survived=1)


def test_a_template_that_fails_on_every_record_leaves_no_store_that_verifies(extract_baseline, runner, tmp_path,
                                                                             figures):
    """A target whose chat template fails on every record: extract exits 2 in one line; the store of
    empty shards it committed is refused by `store verify` (naming the command that re-initialises it),
    `store info`, `vocab`, `train` and `store check`; the same command with the template mended starts
    it afresh (no hand delete) and gives the uninterrupted store."""
    figures.add(trials=1, faults_injected=1)
    target = shutil.copytree(extract_baseline.target, tmp_path / "target")
    template = target / "chat_template.jinja"
    good = template.read_text()
    template.write_text("{{ raise_exception('this chat template is broken') }}")
    out = tmp_path / "s"
    args = ["extract", "--data", extract_baseline.data, "--target", target, "--out", out,
            "--samples-per-shard", "4", "--topk", "8", "--backend", "hf", "--device", "cpu", "--batch-size", "2",
            "--max-seq-len", "256", "--threads", "1"]
    one_line_error(runner.run(*args), "extraction found no usable record", f"store {out} holds no usable sample")
    verify = runner.run("store", "verify", "--store", out)
    assert verify.returncode == 1 and "verify ok" not in verify.stdout, verify.describe()
    assert f"store {out} holds no usable sample" in verify.stderr and "template_error 28" in verify.stderr
    assert f"peagle extract --data {extract_baseline.data} --target {target} --out {out}" in verify.stderr
    info = ok(runner.run("store", "info", "--store", out))
    assert "UNUSABLE" in info.stdout and "peagle extract --data" in info.stdout, info.stdout
    for command in (("vocab", "--store", out, "--draft-vocab-size", "10", "--quiet"),
                    ("train", "--store", out, "--target", target, "--out", tmp_path / "run", "--max-steps", "1"),
                    ("store", "check", "--store", out)):
        one_line_error(runner.run(*command), f"store {out} holds no usable sample", "store info --store")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    template.write_text(good)
    res = ok(runner.run(*args))
    assert "without a usable sample" in res.stdout and "started afresh" in res.stdout, res.stdout
    ok(runner.run("store", "verify", "--store", out))
    got, want = snapshot(out), extract_baseline.files
    assert {k for k in got if got[k] != want.get(k)} <= {"store.json", "manifest.json"} and set(got) == set(want)
    for name in ("store.json", "manifest.json"):  # the target's path differs, and only that
        a, b = (json.loads((s / name).read_text()) for s in (out, extract_baseline.store))
        assert a["target"].pop("path") != b["target"].pop("path") and a == b
    figures.add(faults_survived=1)


def test_a_store_without_a_plan_or_a_shard_is_not_verified(extract_baseline, runner, tmp_path, figures):
    """A store an older peagle left when killed between publishing `store.json` and registering its
    inputs holds nothing and no plan: `verify` fails, `info` and `vocab` say what is missing in one
    line, and the extract command makes it the uninterrupted store."""
    figures.add(trials=1, faults_injected=1)
    out = tmp_path / "s"
    for sub in ("commits", "shards", "inputs"):
        (out / sub).mkdir(parents=True)
    shutil.copy(extract_baseline.store / "store.json", out / "store.json")
    verify = runner.run("store", "verify", "--store", out)
    assert verify.returncode == 1 and "holds nothing: no shard committed and no plan recorded" in verify.stderr, \
        verify.describe()
    info = ok(runner.run("store", "info", "--store", out))
    assert "0 committed, no plan recorded" in info.stdout and "UNUSABLE" in info.stdout, info.stdout
    one_line_error(runner.run("vocab", "--store", out, "--draft-vocab-size", "10", "--quiet"),
                   f"store {out} holds nothing", "peagle extract")
    ok(runner.run(*extract_baseline.args(out)))
    assert snapshot(out) == extract_baseline.files
    figures.add(faults_survived=1)
