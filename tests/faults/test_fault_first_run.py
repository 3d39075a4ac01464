"""A failed first run, empty input and changed input through the real CLI (docs/reliability.md,
"First runs and changed inputs"; issue 37).

* A target that cannot be extracted from (no weights, no tokenizer files, no chat template) is
  refused in one line naming it before the store exists, and the same command with the target
  mended succeeds: a first run never fixes a store's settings with a broken target.
* A store whose first run stopped before its first commit (weights that do not load, a kill) is
  started afresh by the mended command, and the result is the uninterrupted store.
* The same target at another path joins the store (a target is known by its content hash).
* An empty or blank input file, and an empty prompts file for `peagle eval`, exit 2 naming it.
* A data file edited after the store registered it is refused in one line naming it (its old shards
  would stay beside the new ones); `--replace-changed-inputs` drops them and extracts it again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from faultkit import EXTRACT_FLAGS, TRAIN_FLAGS, ok, one_line_error, snapshot


def flags_with(**changes: str) -> list[str]:
    """``EXTRACT_FLAGS`` with some values changed (``{"--topk": "4"}``)."""
    flags = list(EXTRACT_FLAGS)
    for flag, value in changes.items():
        flags[flags.index(flag) + 1] = value
    return flags


def broken_copy(target: Path, out: Path, *remove: str) -> Path:
    """A copy of ``target`` without the files matching the ``remove`` globs."""
    shutil.copytree(target, out)
    for pattern in remove:
        for p in out.glob(pattern):
            p.unlink()
    return out


def without_target_path(files: dict[str, str], store: Path) -> tuple[dict[str, str], dict, dict]:
    """A snapshot without store.json and manifest.json, and those two without the target's path (the
    one thing a store made with a copy of the target records differently)."""
    rest = {k: v for k, v in files.items() if k not in ("store.json", "manifest.json")}
    parsed = []
    for name in ("store.json", "manifest.json"):
        d = json.loads((store / name).read_text())
        d["target"].pop("path")
        parsed.append(d)
    return rest, parsed[0], parsed[1]


def assert_same_store_but_target_path(store: Path, baseline: Path) -> None:
    assert without_target_path(snapshot(store), store) == without_target_path(snapshot(baseline), baseline)


@pytest.mark.parametrize("remove, needle", [
    (("model.safetensors",), "has no weights"),
    (("tokenizer*",), "has no tokenizer files"),
    (("chat_template.jinja",), "has no chat template"),
])
def test_a_broken_target_is_refused_before_the_store_exists(extract_baseline, runner, tmp_path, remove, needle):
    """A target without weights, tokenizer files or chat template is refused in one line naming the
    target and what it lacks, and leaves no store: the same command with the target mended succeeds
    and gives the uninterrupted store (issue 37: a first run's store.json made the mended command
    fail for good, "made with target.content_hash=...")."""
    target = broken_copy(extract_baseline.target, tmp_path / "target", *remove)
    out = tmp_path / "s"
    args = ["extract", "--data", extract_baseline.data, "--target", target, "--out", out, *EXTRACT_FLAGS]
    for dry in (("--dry-run",), ()):
        error = one_line_error(runner.run(*args, *dry), f"target {target}", needle)
        assert "input" not in error and "record" not in error, error  # the target is named, not the data
        assert not out.exists()
    for p in extract_baseline.target.iterdir():  # mend it
        if not (target / p.name).exists():
            shutil.copy(p, target / p.name)
    ok(runner.run(*args))
    assert_same_store_but_target_path(out, extract_baseline.store)


def test_a_target_whose_index_names_a_missing_weight_file_is_refused(extract_baseline, runner, tmp_path):
    """A sharded target with a weight file not (yet) copied is refused naming the file, no store made."""
    target = broken_copy(extract_baseline.target, tmp_path / "target")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (target / "model.safetensors").rename(target / "model-00001-of-00002.safetensors")
    out = tmp_path / "s"
    one_line_error(runner.run("extract", "--data", extract_baseline.data, "--target", target, "--out", out,
                              *EXTRACT_FLAGS), f"target {target} is missing 1 of the 2 weight files",
                   "model-00002-of-00002.safetensors")
    assert not out.exists()


def test_a_store_whose_first_run_failed_before_its_first_commit_is_started_afresh(extract_baseline, runner, tmp_path):
    """A first run that wrote store.json and then failed (weights that do not load; a kill before the
    first commit, with other settings) does not decide the store: the mended command starts it
    afresh and ends with the uninterrupted store, byte for byte."""
    target = broken_copy(extract_baseline.target, tmp_path / "target", "model.safetensors")
    (target / "model.safetensors").write_bytes(b"not safetensors at all")  # present, but does not load
    out = tmp_path / "s"
    args = ["extract", "--data", extract_baseline.data, "--target", target, "--out", out, *EXTRACT_FLAGS]
    one_line_error(runner.run(*args), "cannot load target model")
    assert (out / "store.json").exists() and not list((out / "commits").iterdir())
    shutil.copy(extract_baseline.target / "model.safetensors", target / "model.safetensors")
    ok(runner.run(*args))
    assert_same_store_but_target_path(out, extract_baseline.store)

    # killed before its first commit, with another top-k and another --samples-per-shard
    out = tmp_path / "k"
    first = ["extract", "--data", extract_baseline.data, "--target", extract_baseline.target, "--out", out,
             *flags_with(**{"--topk": "4", "--samples-per-shard": "8"})]
    res = runner.run(*first, env={"PEAGLE_FAILPOINT": "extract.forward:1"})
    assert res.returncode != 0 and not list((out / "commits").iterdir()), res.describe()
    assert list((out / "inputs").glob("*.json"))  # it had registered its inputs: the plan is redone too
    dry = ok(runner.run(*extract_baseline.args(out, "--dry-run")))
    assert "holds no committed shard" in dry.stdout, dry.stdout
    ok(runner.run(*extract_baseline.args(out)))
    assert snapshot(out) == extract_baseline.files
    # a store with a commit record is never started afresh
    one_line_error(runner.run(*first), "topk=8", "topk=4")
    assert snapshot(out) == extract_baseline.files


def test_the_same_target_at_another_path_joins_the_store(extract_baseline, runner, tmp_path):
    """A target is known by its content hash, not its path (as `peagle train` knows it): a worker
    given a copy of the target elsewhere joins the store, and the store is the one-worker store."""
    copy = shutil.copytree(extract_baseline.target, tmp_path / "elsewhere")
    out = tmp_path / "s"
    ok(runner.run(*extract_baseline.args(out, "--num-shards", "2", "--shard-index", "0")))
    ok(runner.run("extract", "--data", extract_baseline.data, "--target", copy, "--out", out, *EXTRACT_FLAGS,
                  "--num-shards", "2", "--shard-index", "1"))
    assert snapshot(out) == extract_baseline.files
    ok(runner.run("store", "verify", "--store", out))
    # other weights at the same path are still refused, naming both targets
    other = broken_copy(extract_baseline.target, tmp_path / "other", "model.safetensors")
    data = bytearray((extract_baseline.target / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (other / "model.safetensors").write_bytes(bytes(data))
    one_line_error(runner.run("extract", "--data", extract_baseline.data, "--target", other, "--out", out,
                              *EXTRACT_FLAGS), f"extracted from target {extract_baseline.target}",
                   f"--target {other} has other weights")


def test_an_empty_input_file_is_refused_naming_it(extract_baseline, runner, tmp_path):
    """A 0-byte, a blank-lines-only JSONL and a 0-row Parquet file exit 2 naming the file, alone or
    beside good data, dry or not, and leave no store (`store verify` cannot call it ok)."""
    empty, blank, rows = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl", tmp_path / "none.parquet"
    empty.write_bytes(b"")
    blank.write_text("\n  \n\r\n")
    pq.write_table(pa.table({"messages": pa.array([], pa.string())}), rows)
    for path, words in ((empty, "is empty"), (blank, "holds only blank lines"), (rows, "holds no records")):
        out = tmp_path / f"s-{path.stem}"
        for data in ((path,), (extract_baseline.data, path)):
            for dry in (("--dry-run",), ()):
                one_line_error(runner.run("extract", "--data", *data, "--target", extract_baseline.target,
                                          "--out", out, *EXTRACT_FLAGS, *dry), f"data file {path} {words}")
                assert not out.exists()
        verify = runner.run("store", "verify", "--store", out)
        assert verify.returncode != 0 and "ok" not in verify.stdout, verify.describe()


def test_a_changed_input_file_is_refused_or_replaced(extract_baseline, runner, tmp_path):
    """Re-running after editing one line of an input file would keep both versions (every other
    record twice): it is refused in one line naming the file, the store untouched; with
    --replace-changed-inputs the old shards are dropped, and the store is the one a fresh extraction
    of the edited file makes."""
    data = tmp_path / "chat.jsonl"
    shutil.copy(extract_baseline.data, data)
    out = tmp_path / "s"
    args = ["extract", "--data", data, "--target", extract_baseline.target, "--out", out, *EXTRACT_FLAGS]
    ok(runner.run(*args))
    before = snapshot(out)
    lines = data.read_text().splitlines(keepends=True)
    record = json.loads(lines[2])
    record["messages"][0]["content"] += " (edited)"
    lines[2] = json.dumps(record) + "\n"
    data.write_text("".join(lines))
    for dry in (("--dry-run",), ()):
        one_line_error(runner.run(*args, *dry), f"data file {data} changed since store {out} registered it",
                       "--replace-changed-inputs")
        assert snapshot(out) == before
    res = ok(runner.run(*args, "--replace-changed-inputs"))
    assert "8 old shards (0-7) dropped" in res.stdout, res.stdout
    fresh = tmp_path / "fresh"
    ok(runner.run("extract", "--data", data, "--target", extract_baseline.target, "--out", fresh, *EXTRACT_FLAGS))
    assert snapshot(out) == snapshot(fresh)
    ok(runner.run("store", "verify", "--store", out))
    assert "nothing to do" in ok(runner.run(*args)).stdout


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_llama) -> Path:
    """A run directory with one checkpoint of a random draft, over a tiny store (as in
    tests/stages/eval/test_run.py)."""
    from peagle.testing.tiny_draft import tiny_eval_run

    return tiny_eval_run(tmp_path_factory.mktemp("eval-prompts"), tiny_llama, num_chats=4, samples_per_shard=4,
                         max_seq_len=128, step=1)


@pytest.mark.parametrize("name, text", [("empty.txt", ""), ("blank.txt", "\n \n"), ("empty.jsonl", ""),
                                        ("blank.jsonl", "\n\n")])
def test_an_empty_prompts_file_is_refused_by_eval(run_dir, tiny_llama, runner, tmp_path, name, text):
    """`peagle eval --prompts FILE` with a file of no prompt exits 2 naming the file (it used to write
    a report of 0 prompts and exit 0), before it exports or loads anything."""
    prompts = tmp_path / name
    prompts.write_text(text)
    out = tmp_path / "report"
    one_line_error(runner.run("eval", run_dir, "--target", tiny_llama, "--mode", "online", "--prompts", prompts,
                              "--max-new-tokens", "4", "--out", out, "--quiet"), f"--prompts {prompts} holds no prompt")
    assert not out.exists()


def test_a_change_the_sampled_hash_misses_is_another_target(extract_baseline, runner, tmp_path):
    """A target whose weights differ only between the content hash's samples (one byte) is another
    target: `peagle train` on the store and `peagle extract` into it refuse it in one line naming the
    full weights hash (they took it for the store's target before)."""
    from peagle.testing.target_faults import flip_an_unsampled_byte

    other = shutil.copytree(extract_baseline.target, tmp_path / "other")
    flip_an_unsampled_byte(other / "model.safetensors")
    store = shutil.copytree(extract_baseline.store, tmp_path / "s")
    one_line_error(runner.run("train", "--store", store, "--target", other, "--out", tmp_path / "run", *TRAIN_FLAGS),
                   f"extracted from target {extract_baseline.target}", "weights sha256", f"--target {other}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    one_line_error(runner.run("extract", "--data", extract_baseline.data, "--target", other, "--out", store,
                              *EXTRACT_FLAGS, "--shard-index", "0"), "weights sha256", f"--target {other}")
    assert snapshot(store) == extract_baseline.files


def test_out_inside_a_store_or_another_run_is_refused(extract_baseline, train_baseline, runner, tmp_path):
    """`--out` inside a shard store (any command), naming a store (but extract and convert), or, for
    `peagle train`, inside another run's directory: one line naming the store or run, nothing created."""
    store, run = extract_baseline.store, train_baseline.run
    before = snapshot(store)
    cases = [(train_baseline.args(store / "run"), f"inside the shard store {store}"),
             (train_baseline.args(store), f"--out {store} is a shard store"),
             (train_baseline.args(run / "inner"), f"inside the run directory {run}"),
             (["export", train_baseline.final, "--out", store / "export"], f"inside the shard store {store}"),
             (["export", train_baseline.final, "--out", store], "is a shard store"),
             (extract_baseline.args(store / "nested"), f"inside the shard store {store}"),
             (["store", "convert", "--store", store, "--hidden-dtype", "fp8", "--out", store / "fp8"],
              f"inside the shard store {store}")]
    for args, needle in cases:
        one_line_error(runner.run(*args), needle)
    assert snapshot(store) == before
    assert not (store / "run").exists() and not (run / "inner").exists() and not (store / "nested").exists()
