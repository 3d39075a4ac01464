"""Checkpoints: committed by rename, checked by sha256, pruned, refused on a changed config or world."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle.pipeline import checkpoint_files as cf
from peagle.schemas.checkpoint import METADATA_FILE
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig
from peagle.schemas.train_resume import config_mismatch
from peagle.stages.train import checkpoint as ckpt


def make_state(value: float = 1.0, world: int = 1) -> dict:
    return {
        ckpt.MODEL: {"w": torch.full((3, 4), value), "b": torch.arange(4.0)},
        ckpt.OPTIMIZER: {"state": {"w": {"exp_avg": torch.ones(3, 4) * value}}, "param_groups": [{"lr": 0.1}]},
        ckpt.LR_SCHEDULER: {"last_epoch": 7},
        ckpt.TRAIN_STATE: {"step": 7, "tokens_seen": 123},
        ckpt.CONFIG: {"train_config": {"lr": 0.1}, "draft_config": {}},
        ckpt.DATALOADER: {"version": 1, "epoch": 0, "batch_in_epoch": 7},
        ckpt.RNG: ckpt.rng_state(),
    }


def test_save_commits_a_whole_directory_and_loads_back(tmp_path):
    path = ckpt.Checkpointer(tmp_path, keep=3).save(7, make_state())
    assert path == tmp_path / "checkpoints" / "step-00000007"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000007"]  # no temp left
    meta = json.loads((path / METADATA_FILE).read_text())
    assert meta["step"] == 7 and set(meta["files"]) == {f"{k}.pt" for k in ckpt.SHARED_PARTS + ckpt.PER_RANK_PARTS}
    assert cf.checkpoint_problem(path) is None
    state = ckpt.load_checkpoint(path)
    assert torch.equal(state[ckpt.MODEL]["w"], torch.ones(3, 4))
    assert state[ckpt.DATALOADER] == {"version": 1, "epoch": 0, "batch_in_epoch": 7}  # this rank's entry
    assert cf.checkpoint_step(path) == 7


def test_keeps_the_newest_k(tmp_path):
    checkpointer = ckpt.Checkpointer(tmp_path, keep=2)
    for step in (2, 4, 6, 8):
        checkpointer.save(step, make_state(step))
    assert [p.name for p in cf.list_checkpoints(tmp_path)] == ["step-00000006", "step-00000008"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000006", "step-00000008"]


def test_damaged_checkpoints_do_not_count_towards_keep(tmp_path):
    """A run restarted from step 0 below damaged checkpoints of higher steps keeps its new good ones;
    the damaged ones go once ``keep`` valid checkpoints of higher steps exist."""
    for step in (40, 80):
        path = ckpt.Checkpointer(tmp_path, keep=2).save(step, make_state(step))
        (path / "model.pt").write_bytes((path / "model.pt").read_bytes()[:-10])
    assert cf.latest_valid_checkpoint(tmp_path) is None
    for step in (10, 20, 30):
        ckpt.Checkpointer(tmp_path, keep=2).save(step, make_state(step))
    names = [p.name for p in cf.list_checkpoints(tmp_path)]
    assert names == ["step-00000020", "step-00000030", "step-00000040", "step-00000080"]
    for step in (40, 50, 60):  # step 40 is written again (replacing the damaged one), then 50, 60
        ckpt.Checkpointer(tmp_path, keep=2).save(step, make_state(step))
    assert [p.name for p in cf.list_checkpoints(tmp_path)] == ["step-00000050", "step-00000060",
                                                                  "step-00000080"]
    for step in (90, 100):
        ckpt.Checkpointer(tmp_path, keep=2).save(step, make_state(step))
    assert [p.name for p in cf.list_checkpoints(tmp_path)] == ["step-00000090", "step-00000100"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000090", "step-00000100"]


def test_rotation_never_deletes_the_newest_checkpoint_with_finite_weights(tmp_path):
    """Checkpoints whose weights went NaN or inf count towards ``keep``, but the newest one with finite
    weights stays until a newer finite one is kept; metadata.json records which is which."""
    checkpointer = ckpt.Checkpointer(tmp_path, keep=1)
    checkpointer.save(2, make_state(2.0))
    for step, value in ((4, float("nan")), (6, float("inf"))):
        checkpointer.save(step, make_state(value))
    assert [p.name for p in cf.list_checkpoints(tmp_path)] == ["step-00000002", "step-00000006"]
    assert [json.loads((p / METADATA_FILE).read_text())["weights_finite"]
            for p in cf.list_checkpoints(tmp_path)] == [True, False]
    ckpt.Checkpointer(tmp_path, keep=1).save(8, make_state(float("nan")))  # another process: reads the record
    assert [p.name for p in cf.list_checkpoints(tmp_path)] == ["step-00000002", "step-00000008"]
    checkpointer.save(10, make_state(10.0))
    assert [p.name for p in cf.list_checkpoints(tmp_path)] == ["step-00000010"]


def test_a_checkpoint_that_records_nothing_of_its_weights_is_read_to_tell(tmp_path):
    """A checkpoint of an older peagle (no ``weights_finite``) counts as finite only if its model part is."""
    checkpointer = ckpt.Checkpointer(tmp_path, keep=1)
    for step, value in ((2, 2.0), (4, float("nan"))):
        path = checkpointer.save(step, make_state(value))
        meta = json.loads((path / METADATA_FILE).read_text())
        del meta["weights_finite"]
        (path / METADATA_FILE).write_text(json.dumps(meta))
    assert [checkpointer.weights_finite(p) for p in cf.list_checkpoints(tmp_path)] == [True, False]
    checkpointer.save(6, make_state(float("nan")))
    assert [p.name for p in cf.list_checkpoints(tmp_path)] == ["step-00000002", "step-00000006"]


def test_a_checkpointer_hashes_a_checkpoint_once_and_remembers_only_its_own(tmp_path, monkeypatch):
    """Pruning after every save checks the kept checkpoints; what this Checkpointer wrote or hashed it
    does not read again (unless a file changed), and another Checkpointer (a resumed process) starts
    with an empty memory: nothing is shared through module state."""
    checked = []
    real = ckpt.checkpoint_problem
    monkeypatch.setattr(ckpt, "checkpoint_problem", lambda path, *a: checked.append(path.name) or real(path, *a))
    writer = ckpt.Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        writer.save(step, make_state(step))
    assert checked == []  # every kept one was written by this object
    resumed = ckpt.Checkpointer(tmp_path, keep=2)
    resumed.save(4, make_state(4))
    assert checked == ["step-00000003"]  # hashed once by the new object ...
    resumed.save(5, make_state(5))
    assert checked == ["step-00000003"]  # ... and remembered
    model = tmp_path / "checkpoints" / "step-00000005" / "model.pt"
    model.write_bytes(model.read_bytes()[:-10])  # a rewritten file changes the signature
    assert not resumed.is_valid(model.parent) and checked[-1] == "step-00000005"


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_metadata", "missing_file"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, damage):
    ckpt.Checkpointer(tmp_path, keep=3).save(2, make_state(2))
    newest = ckpt.Checkpointer(tmp_path, keep=3).save(4, make_state(4))
    model = newest / "model.pt"
    if damage == "flip":
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0xFF
        model.write_bytes(bytes(data))
    elif damage == "truncate":
        model.write_bytes(model.read_bytes()[:-10])
    elif damage == "no_metadata":
        (newest / METADATA_FILE).unlink()
    else:
        (newest / "rng.pt").unlink()
    assert cf.checkpoint_problem(newest) is not None
    assert cf.latest_valid_checkpoint(tmp_path).name == "step-00000002"
    warning = capsys.readouterr().err
    assert "step-00000004" in warning and "damaged" in warning and len(warning.strip().splitlines()) == 1


def test_temp_and_half_deleted_directories_are_invisible_and_cleaned_once_their_process_is_dead(tmp_path):
    root = tmp_path / "checkpoints"
    (root / ".step-00000009.tmp-999999999-abc").mkdir(parents=True)  # a writer that no longer exists
    (root / ".step-00000009.tmp-999999999-abc" / "model.pt").write_bytes(b"half")
    # Killed inside a prune: the old checkpoint renamed away (remove_dir), its rmtree unfinished.
    (root / ".step-00000002.deleted-999999999").mkdir()
    (root / ".step-00000002.deleted-999999999" / "model.pt").write_bytes(b"half gone")
    assert cf.list_checkpoints(tmp_path) == [] and cf.latest_valid_checkpoint(tmp_path) is None
    ckpt.Checkpointer(tmp_path, keep=3).save(1, make_state())
    assert sorted(os.listdir(root)) == ["step-00000001"]


def save_and_get_killed(run_dir: Path, step: int, *, keep: int, failpoint: str) -> None:
    """``Checkpointer.save`` in a child process that SIGKILLs itself at ``failpoint``."""
    script = ("from test_checkpoint import make_state; from peagle.stages.train import checkpoint as c; "
              f"c.Checkpointer({str(run_dir)!r}, keep={keep}).save({step}, make_state({step}))")
    env = {**os.environ, "PEAGLE_FAILPOINT": failpoint,
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def test_killed_before_the_rename_leaves_only_the_previous_checkpoint(tmp_path):
    """SIGKILL between the last fsync and the rename (failpoint): the new step does not exist."""
    ckpt.Checkpointer(tmp_path, keep=3).save(2, make_state(2))
    save_and_get_killed(tmp_path, 4, keep=3, failpoint="train.before_checkpoint_rename")
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert len(leftovers) == 2 and any(name.startswith(".step-00000004.tmp-") for name in leftovers)
    assert cf.latest_valid_checkpoint(tmp_path).name == "step-00000002"
    ckpt.Checkpointer(tmp_path, keep=3).save(4, make_state(4))  # the re-run commits it and sweeps the temp
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002", "step-00000004"]


def test_killed_after_the_rename_leaves_the_new_checkpoint_whole_and_prunes_later(tmp_path):
    """SIGKILL right after the rename, before pruning: the new step is valid, the old one still there."""
    ckpt.Checkpointer(tmp_path, keep=1).save(2, make_state(2))
    save_and_get_killed(tmp_path, 4, keep=1, failpoint="train.after_checkpoint_rename")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002", "step-00000004"]
    assert cf.latest_valid_checkpoint(tmp_path).name == "step-00000004"
    ckpt.Checkpointer(tmp_path, keep=1).save(6, make_state(6))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000006"]


def test_a_failed_write_leaves_no_checkpoint(tmp_path):
    state = make_state()
    state[ckpt.TRAIN_STATE] = {"unpicklable": lambda: None}
    with pytest.raises(Exception):
        ckpt.Checkpointer(tmp_path, keep=3).save(3, state)
    assert os.listdir(tmp_path / "checkpoints") == []


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(123), np.random.seed(5), random.seed(9)
    ckpt.set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_seed_rngs_seeds_every_saved_rng():
    ckpt.seed_rngs(11)
    drawn = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(drawn[0], torch.rand(2, generator=torch.Generator().manual_seed(11)))
    assert np.array_equal(drawn[1], np.random.RandomState(11).rand(2)) and drawn[2] == random.Random(11).random()


def test_loading_on_another_world_size_is_refused(tmp_path):
    path = ckpt.Checkpointer(tmp_path, keep=3).save(1, make_state())
    # Rewrite the per-rank part as a 2-rank run would have, keeping checksums right.
    torch.save({"world_size": 2, "rank_0": {}, "rank_1": {}}, path / "dataloader.pt")
    with pytest.raises(UserError, match="written by 2 processes, this run has 1"):
        ckpt.load_checkpoint(path)


# ------------------------------------------------------------------------------------------------
# Config changes on resume


def config(**kw) -> TrainConfig:
    return TrainConfig.from_flags(**{"store": ("s",), "target": "t", "out": "o", **kw})


def test_a_changed_config_names_the_field_and_both_values():
    saved = config(lr=1e-4).to_dict()
    line = config_mismatch(saved, config(lr=3e-4))
    assert line is not None and "--lr" in line and "0.0001" in line and "0.0003" in line and "\n" not in line
    assert "--num-layers was 4" in config_mismatch(saved, config(num_layers=2))
    assert config_mismatch(saved, config(max_bad_steps=10)) is None  # a run stopped for bad steps resumes with more


def test_a_resumed_run_keeps_its_draft_variant():
    """The variant flags rebuild the draft on resume, so none may change; a checkpoint from before
    they existed reads as the plain Llama draft it was, not as today's default (the norms on)."""
    saved = config(draft_architecture="qwen3", fc_norm=False).to_dict()
    assert "--draft-architecture was 'qwen3'" in config_mismatch(saved, config(fc_norm=False))
    assert "--fc-norm was False" in config_mismatch(saved, config(draft_architecture="qwen3"))
    plain = dict(norm_before_residual=False, norm_before_fc=False, fc_norm=False)  # the draft before the norms
    old = {k: v for k, v in config(**plain).to_dict().items()
           if k not in ("draft_architecture", "norm_before_residual", "norm_before_fc", "fc_norm")}
    assert config_mismatch(old, config(**plain)) is None
    assert "--norm-before-residual was False" in config_mismatch(old, config())  # today's default has the norms
    assert "--norm-before-fc was False" in config_mismatch(old, config(**{**plain, "norm_before_fc": True}))
    with pytest.raises(UserError, match=r"--draft-architecture must be one of llama\|qwen3"):
        config(draft_architecture="mistral")


def test_a_run_from_before_optimizer_choices_resumes_only_as_adamw():
    """Checkpoints written before --optimizer existed trained with AdamW: resuming one under today's
    default (Muon) names the change instead of switching optimizers mid-run."""
    old = {k: v for k, v in config(optimizer="adamw").to_dict().items() if k not in ("optimizer", "muon_lr", "loss")}
    assert config_mismatch(old, config(optimizer="adamw")) is None
    assert config_mismatch(old, config()) == ("--optimizer was 'adamw' in the checkpointed run and is 'muon' now; "
                                              "resume with the same value or use a new --out")


def test_safe_fields_may_change_and_paths_compare_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = config(max_steps=10, store=("s",)).to_dict()
    assert config_mismatch(saved, config(max_steps=50, eval_every=3, store=(str(tmp_path / "s"),))) is None
    assert config_mismatch(saved, config(max_steps=10, store=("s:0.5",))) is not None
