"""Non-finite values through the real CLI (docs/reliability.md, "One owner, finite weights"): a NaN in
a store does not reach the weights, a run with too many NaN steps stops in one line naming the samples
and keeps its last good checkpoint, and NaN weights are refused by `peagle export` and by
`peagle train --init-from`.

The NaN store is written the way a buggy extractor would have written it (``store_faults.rewrite_shard``:
re-encoded and committed with fresh sizes, checksums and statistics), so that it is intact by every
check of the store's own integrity and reaches the trainer; its commit statistics do show the
non-finite row, so training needs ``--allow-bad-aux-rows`` to read it, and what stops the NaN then is
the trainer's guard alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from faultkit import TRAIN_STEPS, ok, one_line_error
from peagle.model.finite import non_finite_tensors, recorded_finite
from peagle.pipeline.checkpoint_files import checkpoint_problem, list_checkpoints
from peagle.testing.store_faults import rewrite_shard

AREA = "train"
SHARD = 2


def nan_store(extract_baseline, root: Path) -> tuple[Path, str]:
    """A copy of the baseline store with ONE aux value of one sample NaN (shard ``SHARD``, its first
    sample, a row it trains on); returns the store and that sample's id."""
    store = root / "nan-store"
    shutil.copytree(extract_baseline.store, store)
    chosen: list[str] = []

    def edit(states_TAH, ids_Tk, lps_Tk, columns):
        chosen.append(columns.sample_ids[0])
        states_TAH[columns.tensor_rows(0).start + 1, 0, 0] = float("nan")

    before = (store / "shards" / f"{SHARD:05d}.safetensors").stat().st_size
    rewrite_shard(store, SHARD, edit)
    assert (store / "shards" / f"{SHARD:05d}.safetensors").stat().st_size == before
    return store, chosen[0]


def train_args(base, store: Path, run: Path, *extra: str) -> list[str]:
    args = list(base.args(run, *extra))
    args[args.index("--store") + 1] = str(store)
    return args


def finite_weights(checkpoint: Path) -> bool:
    return not non_finite_tensors(torch.load(checkpoint / "model.pt", weights_only=True))


def test_a_nan_in_the_store_never_reaches_the_weights(extract_baseline, train_baseline, runner, tmp_path, figures):
    """One NaN aux value in a committed shard: its steps are skipped, counted and their samples recorded;
    every checkpoint's weights stay finite. With --max-bad-steps 0 the first such step stops the run in
    one line naming the store, shard and sample, after a checkpoint of the last good weights."""
    store, sample_id = nan_store(extract_baseline, tmp_path)
    figures.add(trials=3, faults_injected=3)
    # The premise: the store's statistics show the row, so it is refused unless told otherwise.
    one_line_error(runner.run(*train_args(train_baseline, store, tmp_path / "refused")), "non-finite",
                   "--allow-bad-aux-rows")
    figures.add(faults_survived=1)

    stopped = tmp_path / "stopped"
    res = runner.run(*train_args(train_baseline, store, stopped, "--allow-bad-aux-rows", "--max-bad-steps", "0"))
    line = one_line_error(res, "1 step had a non-finite loss or gradient norm, more than --max-bad-steps 0",
                          f"store {store} shard {SHARD:05d} (", sample_id, "keeps the last good weights")
    (bad,) = [json.loads(x) for x in (stopped / "bad_steps.jsonl").read_text().splitlines()]
    assert sample_id in [s["sample_id"] for s in bad["samples"]]
    kept = stopped / "checkpoints" / f"step-{bad['step']:08d}"
    assert str(kept) in line and checkpoint_problem(kept) is None
    assert recorded_finite(kept) is True and finite_weights(kept)
    figures.add(faults_survived=1)

    survived = tmp_path / "survived"
    ok(runner.run(*train_args(train_baseline, store, survived, "--allow-bad-aux-rows")))  # default budget: 3
    records = [json.loads(x) for x in (survived / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    bad_lines = [json.loads(x) for x in (survived / "bad_steps.jsonl").read_text().splitlines()]
    assert 1 <= sum(r["bad_steps"] for r in steps) == len(bad_lines) <= 3
    assert all(sample_id in [s["sample_id"] for s in b["samples"]] for b in bad_lines)
    assert all(r["loss"] is None or r["loss"] == r["loss"] for r in steps)  # no NaN in the metrics
    assert steps[-1]["step"] == TRAIN_STEPS
    assert all(finite_weights(p) for p in list_checkpoints(survived))
    figures.add(faults_survived=1)


def nan_checkpoint(source: Path, dest: Path) -> Path:
    """A copy of checkpoint ``source`` with one NaN weight, committed consistently (sizes and sha256 in
    its metadata match), as a run whose weights went bad would have written it."""
    import hashlib

    shutil.copytree(source, dest)
    model = torch.load(dest / "model.pt", weights_only=True)
    name = next(n for n, t in model.items() if t.is_floating_point() and t.dim() == 2)
    model[name].view(-1)[0] = float("nan")
    torch.save(model, dest / "model.pt")
    meta = json.loads((dest / "metadata.json").read_text())
    data = (dest / "model.pt").read_bytes()
    meta["files"]["model.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["weights_finite"] = False
    (dest / "metadata.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    assert checkpoint_problem(dest) is None
    return dest


def test_nan_weights_are_refused_by_export_and_by_init_from(train_baseline, runner, tmp_path, figures):
    """`peagle export` of a checkpoint with a NaN weight is one line (naming the tensor and the run's
    newest finite checkpoint), and writes nothing; `peagle train --init-from` an export with a NaN weight
    is one line, before any step."""
    figures.add(trials=2, faults_injected=2)
    run = tmp_path / "run"
    good = list_checkpoints(train_baseline.run)[-2]
    shutil.copytree(good, run / "checkpoints" / good.name)
    bad = nan_checkpoint(train_baseline.final, run / "checkpoints" / train_baseline.final.name)
    res = runner.run("export", run, "--out", tmp_path / "export")
    one_line_error(res, f"checkpoint {bad} holds non-finite weights", f"export {run / 'checkpoints' / good.name} instead")
    assert not (tmp_path / "export").exists()
    res = runner.run("eval", bad, "--out", tmp_path / "report")  # eval exports a checkpoint itself
    one_line_error(res, f"checkpoint {bad} holds non-finite weights")
    assert not (tmp_path / "report" / "export").exists()
    figures.add(faults_survived=1)

    export = tmp_path / "good-export"
    ok(runner.run("export", train_baseline.final, "--out", export))
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    name = sorted(k for k, t in tensors.items() if t.is_floating_point())[0]
    tensors[name].view(-1)[-1] = float("inf")
    save_file(tensors, str(export / "model.safetensors"), metadata=metadata)
    res = runner.run(*train_baseline.args(tmp_path / "warm", "--init-from", str(export)))
    one_line_error(res, f"--init-from {export}: model.safetensors holds non-finite values (NaN or inf) in 1 tensor ({name})")
    assert not (tmp_path / "warm" / "metrics.jsonl").exists()
    figures.add(faults_survived=1)
