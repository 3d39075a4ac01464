"""The shared target-training helpers (peagle.demo.target_training): the cache entry is
published whole or not at all, and the step-only schedule ignores the clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle.demo.target_training import LmTraining, cached_model_dir, train_lm


def test_cache_entry_is_published_whole_or_not_at_all(tmp_path) -> None:
    def failing(work: Path) -> Path:
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        cached_model_dir(tmp_path, "entry", failing)
    assert list(tmp_path.iterdir()) == []  # neither the entry nor the work directory

    calls = []

    def build(work: Path) -> Path:
        calls.append(work)
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text("{}")
        return work / "model"

    out = cached_model_dir(tmp_path, "entry", build)
    assert out == tmp_path / "entry" and (out / "config.json").exists()
    assert cached_model_dir(tmp_path, "entry", build) == out and len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_lost_publish_race_keeps_the_winner(tmp_path) -> None:
    def build(work: Path) -> Path:
        winner = tmp_path / "entry"  # another process publishes while this one builds
        winner.mkdir()
        (winner / "config.json").write_text('{"winner": true}')
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text("{}")
        (work / "model" / "weights").write_text("x")
        return work / "model"

    out = cached_model_dir(tmp_path, "entry", build)
    assert (out / "config.json").read_text() == '{"winner": true}' or (out / "weights").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_step_only_schedule_trains_every_step_and_decays() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids):
            return type("Out", (), {"logits": self.inner(input_ids)})

    data = torch.arange(64) % 16
    windows = iter(lambda: data[:9], None)
    stats = train_lm(Wrapped(), windows, LmTraining(max_steps=30, seq_len=8, batch_size=4, lr=1e-2, seed=0,
                                                    warmup_steps=5, log_every=1000), log=lambda m: None)
    assert stats["steps"] == 30 and stats["final_loss_ema"] < 2.5  # ln 16 = 2.77 at the start
