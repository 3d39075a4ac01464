"""A store or a run from elsewhere names only its own files (docs/reliability.md; issue 58).

A store copied from another machine, unpacked from an archive or made by hand may hold names that
lead out of it: a commit record whose ``parquet`` or ``safetensors`` is ``../x`` or an absolute
path, a shard file or the ``shards/`` directory as a symbolic link to somewhere else, an input
registration whose ``sha256`` is ``../../victim``, a run whose ``checkpoints/`` is a link. Each form
is planted into a copy of the baseline store (or run), and every command that reads, rewrites or
deletes what those names name -- `store verify`, `vocab`, `train`, `store convert`, `extract`
restarting an unusable store, `extract --replace-changed-inputs`, `train` resuming (and pruning) a
run -- must refuse it in one line naming the file and the field, before anything is read, written
or deleted: the victim outside (a copy of the shard's own files, so every size and sha256 matches)
keeps its bytes, and nothing appears or changes anywhere around the store.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from faultkit import EXTRACT_FLAGS, TRAIN_FLAGS, one_line_error
from peagle.pipeline.atomic import canonical_json
from peagle.pipeline.store import manifest_dict, read_settings
from peagle.schemas import store as S
from peagle.testing.chat_data import write_chat_jsonl

AREA = "files from elsewhere"
SHARD = "00003"
REFUSED = "refused: nothing read, written or deleted"


def tree_state(root: Path) -> dict[str, str]:
    """Every entry under ``root`` without following links: a file by its sha256, a link by its target
    (lock files left out: taking a lock is not writing)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                state[rel] = "link -> " + os.readlink(path)
            elif path.is_file() and name != ".lock":
                state[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def edit_record(store: Path, index: str, **fields) -> None:
    """Edit a commit record, and derive the manifest from the records again, as a crafted store would:
    nothing but the names says anything is wrong."""
    path = store / "commits" / f"{index}.json"
    record = json.loads(path.read_text())
    record.update(fields)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    records = [S.ShardRecord.from_dict(json.loads(p.read_text())) for p in sorted((store / "commits").glob("*.json"))]
    (store / S.MANIFEST_FILE).write_bytes(canonical_json(manifest_dict(read_settings(store), records)))


@dataclass(frozen=True)
class Form:
    """One way a store names a file outside itself, planted into ``store`` (whose sibling ``victim/``
    holds copies of the shard's files); ``field`` is what the error must name."""

    name: str
    plant: Callable[[Path, Path], None]
    field: str


def _dotdot(store: Path, victim: Path) -> None:
    edit_record(store, SHARD, parquet=f"../{victim.name}/{SHARD}.parquet")


def _absolute(store: Path, victim: Path) -> None:
    edit_record(store, SHARD, safetensors=str(victim / f"{SHARD}.safetensors"))


def _linked_file(store: Path, victim: Path) -> None:
    link = store / "shards" / f"{SHARD}.safetensors"
    link.unlink()
    link.symlink_to(victim / f"{SHARD}.safetensors")


def _linked_dir(store: Path, victim: Path) -> None:
    for p in (store / "shards").iterdir():
        shutil.copyfile(p, victim / p.name)
    shutil.rmtree(store / "shards")
    (store / "shards").symlink_to(victim, target_is_directory=True)


FORMS = [Form("dotdot", _dotdot, "parquet"), Form("absolute", _absolute, "safetensors"),
         Form("linked_file", _linked_file, "safetensors"), Form("linked_dir", _linked_dir, "parquet")]
BY_NAME = {f.name: f for f in FORMS}


def planted(base: Path, tmp_path: Path, form: Form, *, unusable: bool = False) -> tuple[Path, Path]:
    """(store, victim): a copy of ``base`` at ``tmp_path/store`` with ``form`` planted; ``victim`` beside
    it holds copies of shard SHARD's files and a bystander. ``unusable``: every commit record says its
    shard holds no sample (a store the next extract with other settings starts afresh)."""
    store, victim = tmp_path / "store", tmp_path / "victim"
    shutil.copytree(base, store)
    victim.mkdir()
    for suffix in ("parquet", "safetensors"):
        shutil.copyfile(store / "shards" / f"{SHARD}.{suffix}", victim / f"{SHARD}.{suffix}")
    (victim / "bystander.txt").write_text("not peagle's\n")
    if unusable:
        for record in (store / "commits").glob("*.json"):
            edit_record(store, record.stem, num_samples=0)
    form.plant(store, victim)
    return store, victim


def refused(res, store: Path, form: Form) -> str:
    """The command failed in one line naming the commit record and the field, as refused."""
    field = f"{form.field} " if form.name != "linked_dir" else ""  # every record leads out: the first is named
    return one_line_error(res, str(store / "commits"), field, REFUSED)


def _commands(base, store: Path, tmp_path: Path) -> dict[str, list]:
    return {
        "verify": ["store", "verify", "--store", store],
        "vocab": ["vocab", "--store", store, "--draft-vocab-size", "64", "--quiet"],
        "train": ["train", "--store", store, "--target", base.target, "--out", tmp_path / "run", *TRAIN_FLAGS,
                  "--max-steps", "1"],
        "convert": ["store", "convert", "--store", store, "--hidden-dtype", "fp8", "--out", tmp_path / "fp8"],
    }


CASES = [(form, command) for form in BY_NAME for command in ("verify", "vocab", "convert")] + [
    ("dotdot", "train"), ("linked_dir", "train")]


@pytest.mark.parametrize("form,command", CASES)
def test_a_store_naming_files_outside_itself_is_refused(form, command, extract_baseline, runner, tmp_path, figures):
    """`store verify`, `vocab`, `train` and `store convert` on a store whose commit record names a file
    outside it (``../``, an absolute path, a linked file or shard directory) refuse in one line naming the
    record and the field, and read or write nothing outside (the victim keeps its bytes, no `--out` is made)."""
    store, victim = planted(extract_baseline.store, tmp_path, BY_NAME[form])
    before = tree_state(tmp_path)
    res = runner.run(*_commands(extract_baseline, store, tmp_path)[command])
    figures.add(bad_inputs_tried=1)
    refused(res, store, BY_NAME[form])
    assert tree_state(tmp_path) == before
    figures.add(bad_inputs_handled=1)


@pytest.mark.parametrize("form", list(BY_NAME))
def test_restarting_an_unusable_store_deletes_nothing_outside_it(form, extract_baseline, runner, tmp_path, figures):
    """`peagle extract` with other settings into a store of no usable shard (which it would start afresh,
    deleting the files its commit records name) refuses a record naming a file outside the store: the
    victim is still there, byte for byte, and nothing is written through a linked shard directory."""
    store, victim = planted(extract_baseline.store, tmp_path, BY_NAME[form], unusable=True)
    before = tree_state(tmp_path)
    res = runner.run(*extract_baseline.args(store, "--topk", "4"))
    figures.add(bad_inputs_tried=1)
    refused(res, store, BY_NAME[form])
    assert tree_state(tmp_path) == before
    figures.add(bad_inputs_handled=1)


def test_a_registration_named_outside_the_store_deletes_nothing(extract_baseline, runner, tmp_path, figures):
    """An input registration whose ``sha256`` is ``../../victim`` (``--replace-changed-inputs`` deletes the
    registration of a changed file by that name) is refused in one line naming the file and the field;
    the victim two directories up from ``inputs/`` is still there."""
    store = tmp_path / "store"
    shutil.copytree(extract_baseline.store, store)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 6, seed=31)
    crafted = store / "inputs" / f"{'f' * 64}.json"
    crafted.write_text(json.dumps({"sha256": "../../victim", "name": data.name, "num_records": 6,
                                   "records_per_shard": 4, "first_shard": 100, "end_shard": 102,
                                   "path": str(Path(data).absolute())}))
    (tmp_path / "victim.json").write_text('{"not": "peagle\'s"}\n')
    before = tree_state(tmp_path)
    res = runner.run("extract", "--data", data, "--target", extract_baseline.target, "--out", store, *EXTRACT_FLAGS,
                     "--replace-changed-inputs")
    figures.add(bad_inputs_tried=1)
    one_line_error(res, str(crafted), "sha256 '../../victim'", REFUSED)
    assert tree_state(tmp_path) == before
    figures.add(bad_inputs_handled=1)


def test_a_run_whose_checkpoints_lead_outside_is_not_pruned(train_baseline, runner, tmp_path, figures):
    """A run whose ``checkpoints/`` is a link to a directory elsewhere is refused in one line when resumed
    (whose saves would prune the checkpoints there): nothing there is deleted or written."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(train_baseline.run, run)
    shutil.move(run / "checkpoints", elsewhere)
    (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    before = tree_state(elsewhere)
    res = runner.run(*train_baseline.args(run, "--max-steps", "14"))
    figures.add(bad_inputs_tried=1)
    one_line_error(res, str(run), "checkpoints", REFUSED)
    assert tree_state(elsewhere) == before
    figures.add(bad_inputs_handled=1)


def test_a_run_whose_metrics_file_leads_outside_is_neither_read_nor_written(train_baseline, runner, tmp_path, figures):
    """A run's ``metrics.jsonl`` that is a link to a file elsewhere: the resumed run (which cuts the file
    back to its checkpoint's step and appends to it) and ``peagle eval`` of the run (which reads it)
    each refuse it in one line; the file there keeps its bytes and eval writes no report."""
    run, victim = tmp_path / "run", tmp_path / "victim.jsonl"
    shutil.copytree(train_baseline.run, run)
    victim.write_text('{"not": "peagle\'s", "step": 99}\n')
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    resumed = runner.run(*train_baseline.args(run, "--max-steps", "14"))
    evaluated = runner.run("eval", run, "--target", train_baseline.target, "--store", train_baseline.store,
                           "--out", tmp_path / "report", "--mode", "offline")
    figures.add(bad_inputs_tried=2)
    for res in (resumed, evaluated):
        one_line_error(res, f"run {run}: path 'metrics.jsonl'", REFUSED)
    assert victim.read_text() == '{"not": "peagle\'s", "step": 99}\n'
    assert not list((tmp_path / "report").glob("**/report.json"))  # eval stopped before its report
    figures.add(bad_inputs_handled=2)


LOCKS = {"store": ".lock", "store_writers": "inputs/.lock", "run": ".lock"}


@pytest.mark.parametrize("where", list(LOCKS))
def test_a_lock_file_linked_out_of_its_tree_is_not_written(where, extract_baseline, train_baseline, runner, tmp_path,
                                                           figures):
    """A store's or a run's lock file that is a link to a file elsewhere is refused in one line by the
    command that would take the lock (a lock holder writes its pid into the file): the file there keeps
    its bytes."""
    tree = tmp_path / where
    shutil.copytree(train_baseline.run if where == "run" else extract_baseline.store, tree)
    victim = tmp_path / "victim.txt"
    victim.write_text("not peagle's\n")
    lock = tree / LOCKS[where]
    lock.unlink(missing_ok=True)
    lock.symlink_to(victim)
    args = train_baseline.args(tree) if where == "run" else extract_baseline.args(tree)
    res = runner.run(*args)
    figures.add(bad_inputs_tried=1)
    one_line_error(res, f"{'run' if where == 'run' else 'store'} {tree}: path '{LOCKS[where]}'", REFUSED)
    assert victim.read_text() == "not peagle's\n"
    figures.add(bad_inputs_handled=1)
