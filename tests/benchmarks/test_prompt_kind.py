"""benchmarks/prompt_kind.py: which prompts the target's own held-out set must not repeat, and the
one-line refusals of a malformed --export."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest


@pytest.fixture()
def prompt_kind(load_benchmark):
    with load_benchmark("prompt_kind.py") as module:
        yield module


def _write(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))


def test_every_part_and_the_templated_heldout_set_are_excluded_and_nothing_else(prompt_kind, tmp_path):
    _write(tmp_path / "prompts-a.jsonl", ["How do tides work?"])
    _write(tmp_path / "prompts-d.jsonl", ["Write a haiku about rain."])
    _write(tmp_path / "heldout-all.jsonl", ["Who was Johannes Gutenberg?"])
    _write(tmp_path / "eval-prompts.jsonl", ["Who was Johannes Gutenberg?"])  # a subset of heldout-all
    _write(tmp_path / "magpie-heldout.jsonl", ["What is a prime number?"])  # the set being made
    found = [c["messages"][0]["content"] for c in prompt_kind.training_prompts(tmp_path)]
    assert sorted(found) == ["How do tides work?", "Who was Johannes Gutenberg?", "Write a haiku about rain."]


def test_prompt_facts_count_prompts_and_their_mean_words(prompt_kind, tmp_path):
    _write(tmp_path / "p.jsonl", ["one two three", "one"])
    assert prompt_kind.prompt_facts(tmp_path / "p.jsonl") == {"file": "p.jsonl", "prompts": 2, "mean_words": 2.0}


def test_an_export_flag_wants_a_name_and_an_export_directory(prompt_kind, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert prompt_kind.parse_export(f"peagle={tmp_path}") == ("peagle", tmp_path)
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=EXPORT_DIR"):
        prompt_kind.parse_export(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="not a peagle export"):
        prompt_kind.parse_export(f"x={tmp_path / 'missing'}")


def test_a_smaller_set_from_an_earlier_run_is_refused_not_served(prompt_kind, tmp_path):
    (tmp_path / "data").mkdir()
    _write(tmp_path / "data" / "magpie-heldout.jsonl", ["What is a prime number?"])
    assert prompt_kind.own_prompts(tmp_path, Path("/t"), 1, []) == tmp_path / "data" / "magpie-heldout.jsonl"
    with pytest.raises(SystemExit, match="fewer than --num-prompts 2"):
        prompt_kind.own_prompts(tmp_path, Path("/t"), 2, [])
