"""benchmarks/train_step_profile.py: every variant is one recipe's `peagle train` with its own flags, and
the profiled milliseconds become shares of the step with nested labels taken out of their parents."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture()
def profile(load_benchmark):
    with load_benchmark("train_step_profile.py") as module:
        yield module


def test_each_variant_is_the_recipe_with_its_flags_once(profile):
    for name, flags in profile.VARIANTS.items():
        args = profile.train_args(Path("/s"), Path("/t"), Path("/o"), 7, flags)
        pairs = {word: value for word, value in zip(args, args[1:]) if word.startswith("--") and not value.startswith("--")}
        assert pairs["--num-depths"] == "8" and pairs["--max-steps"] == "7", name  # K_train 8 throughout
        for flag in ("--num-layers", "--token-budget", "--num-depths"):
            assert args.count(flag) == 1, (name, flag)
        assert pairs["--num-layers"] == name.split("-")[0], name


def test_shares_take_the_nested_parts_out_of_their_parents(profile):
    ms = {"step": 1000.0, "forward": 300.0, "attention": 100.0, "attention backward": 50.0, "lm head + loss": 80.0,
          "backward": 400.0, "optimizer": 250.0, "muon newton-schulz": 200.0}
    shares = profile.shares(ms, data_wait_share=0.02)
    assert shares["attention"] == 0.15 and shares["muon newton-schulz"] == 0.2
    assert shares["forward, the rest"] == 0.12 and shares["backward, the rest"] == 0.35
    assert shares["optimizer, the rest"] == 0.05 and shares["step, the rest"] == pytest.approx(0.05)
    assert sum(v for k, v in shares.items() if not k.startswith("data wait")) == pytest.approx(1.0)
    assert shares["data wait (of the trainer's wall)"] == 0.02
