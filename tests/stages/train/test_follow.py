"""Training on a growing store (follow.py): which shards each epoch covers, waiting for news, the record,
resume and replay, the end of a --follow run; and the loader's refusal of an incomplete store. In-process,
on a copy of the tiny store with its last commit records taken away (extraction "still running")."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from peagle.schemas.errors import UserError
from peagle.schemas.loader_config import CodSettings, LoaderConfig
from peagle.schemas.train_config import StoreSpec, TrainConfig
from peagle.stages.train import follow
from peagle.stages.train.loader import TrainLoader

COD = CodSettings(num_depths=3)


@pytest.fixture
def growing(tiny_store, tmp_path) -> tuple[Path, Path]:
    """The tiny store (8 planned shards) with shards 4-7 not committed yet; their records wait in ``held``."""
    root = tmp_path / "store"
    shutil.copytree(tiny_store.root, root)
    held = tmp_path / "held"
    held.mkdir()
    for i in range(4, 8):
        (root / "commits" / f"{i:05d}.json").rename(held / f"{i:05d}.json")
    return root, held


def commit(root: Path, held: Path, *indices: int) -> None:
    for i in indices:
        (held / f"{i:05d}.json").rename(root / "commits" / f"{i:05d}.json")


def shards_of(loader: TrainLoader, epoch: int) -> set[int]:
    """The store shards the rank's batches of ``epoch`` read."""
    _, plan, stores, index = loader._epoch(epoch)
    refs = plan.refs_of_rank[0][:plan.bounds_of_rank[0][plan.num_batches]]
    return {stores[0].shards[int(j)].index for j in index.shard_of[refs]}


def test_an_incomplete_store_is_refused_naming_the_missing_shards_unless_allowed(growing, caplog):
    root, _ = growing
    cfg = LoaderConfig(stores=(StoreSpec(str(root)),), token_budget=400, cod=COD)
    with pytest.raises(UserError, match=r"incomplete: 4 of 8 shards committed \(missing: shards 4-7.*--allow-incomplete"):
        TrainLoader(cfg)
    TrainLoader(LoaderConfig(**{**cfg.__dict__, "allow_incomplete": True}))
    assert "training on 4 of 8 shards committed" in caplog.text and "% of the planned records missing" in caplog.text


def test_each_epoch_covers_what_was_committed_when_it_began_and_waits_for_news(growing):
    root, held = growing
    said: list[str] = []
    recorded: dict[int, follow.EpochShards] = {}
    source = follow.FollowSource([root], timeout_s=30, say=said.append, poll_s=0.05)
    cfg = LoaderConfig(stores=(StoreSpec(str(root)),), token_budget=400, cod=COD)
    loader = TrainLoader(cfg, source=source, on_epoch=lambda e, s: recorded.__setitem__(e, s))
    assert shards_of(loader, 0) == {0, 1, 2, 3} and recorded[0].shards == ((0, 1, 2, 3),)
    assert recorded[0].num_planned == (8,) and not recorded[0].complete

    commit(root, held, 4)  # extraction goes on: the next epoch takes it in
    assert shards_of(loader, 1) == {0, 1, 2, 3, 4}
    # nothing new: the next epoch waits (here until a commit arrives from "another process")
    import threading

    threading.Timer(0.3, commit, (root, held, 5, 6, 7)).start()
    started = time.monotonic()
    assert shards_of(loader, 2) == set(range(8)) and time.monotonic() - started >= 0.25
    assert "epoch 2: waiting for extraction to commit a new shard (5 of 8 shards of store committed" in said[0]
    assert recorded[2].complete
    assert shards_of(loader, 3) == set(range(8))  # complete: every epoch covers it all, without waiting
    assert len(said) == 1

    # the loader state holds what each epoch covered: a new loader resumes exactly
    state = loader.state_dict()
    assert sorted(state["epoch_shards"]) == ["0", "1", "2", "3"]
    again = TrainLoader(cfg, source=follow.FollowSource([root], timeout_s=30, say=said.append))
    state_one = {**state, "epoch": 1}
    again.load_state_dict(state_one)
    assert shards_of(again, 1) == {0, 1, 2, 3, 4}
    assert [b.sample_ids for b in again.batches(1)] == [b.sample_ids for b in loader.batches(1)]


def test_a_stalled_extraction_ends_the_wait_in_one_line(growing):
    root, _ = growing
    source = follow.FollowSource([root], timeout_s=0.2, say=lambda _: None, poll_s=0.05)
    first = source(0, None)
    with pytest.raises(UserError, match=r"no shard was committed for 0.2 s.*missing: shards 4-7.*resumes"):
        source(1, first)


def test_replay_repeats_the_record_and_refuses_a_changed_store(growing, tmp_path):
    root, held = growing
    record = follow.epochs_record([root], {0: follow.snapshot([root])}, {0: 0})
    path = tmp_path / "epochs.json"
    path.write_text(json.dumps(record))
    commit(root, held, 4, 5, 6, 7)
    replay = follow.ReplaySource([root], path)
    assert replay(0, None).shards == ((0, 1, 2, 3),)
    assert replay(1, None).shards == (tuple(range(8)),)  # not in the record: everything committed
    commit_1 = root / "commits" / "00001.json"
    changed = json.loads(commit_1.read_text())
    changed["num_truncated"] += 1
    commit_1.write_text(json.dumps(changed))
    with pytest.raises(UserError, match="epoch 0 was recorded with shards 0-3 .* the store changed since"):
        replay(0, None)
    path.write_text("[1, 2]")
    with pytest.raises(UserError, match="not an epochs record"):
        follow.ReplaySource([root], path)


def test_the_end_of_a_follow_run(growing):
    root, held = growing
    consumed = {0: follow.snapshot([root])}
    with pytest.raises(UserError, match=r"40 steps of --max-steps are spent but store .* is still incomplete "
                                        r"\(4 of 8 shards committed.*--allow-incomplete"):
        follow.end_of_follow(follow.snapshot([root]), [root], consumed, max_steps=40, allow_incomplete=False)
    lines = follow.end_of_follow(follow.snapshot([root]), [root], consumed, max_steps=40, allow_incomplete=True)
    assert len(lines) == 1 and lines[0].startswith("warning: ")
    commit(root, held, 4, 5, 6, 7)
    lines = follow.end_of_follow(follow.snapshot([root]), [root], consumed, max_steps=40, allow_incomplete=False)
    assert lines == [f"warning: shards 4-7 of store {root} were committed after the last epoch began and were not "
                     "trained on (a larger --max-steps trains on them)"]
    consumed[1] = follow.snapshot([root])
    assert follow.end_of_follow(consumed[1], [root], consumed, max_steps=40, allow_incomplete=False) == []


def test_follow_needs_a_step_budget():
    base = dict(store=("s",), target="t", out="o")
    with pytest.raises(UserError, match="--follow needs --max-steps"):
        TrainConfig.from_flags(**base, follow=True)
    with pytest.raises(UserError, match="exclusive"):
        TrainConfig.from_flags(**base, follow=True, max_steps=5, epoch_shards="e.json")
    assert TrainConfig.from_flags(**base, follow=True, max_steps=5).data.follow
