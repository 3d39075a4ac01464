"""benchmarks/data_scaling.py: part d (the 'double' point) is made of new target-written prompts
only, and the first parts stay as they were (their stores and drafts are reused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture()
def scaling(load_benchmark):
    with load_benchmark("data_scaling.py") as module:
        yield module


def _chats(texts: list[str]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": t}]} for t in texts]


def _write(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in _chats(texts)))


def test_part_d_holds_only_prompts_the_first_parts_lack(scaling, tmp_path) -> None:
    first = _chats(["How do I bake bread?", "Name three rivers."])
    _write(tmp_path / "data" / "magpie-more-0.jsonl",  # written already: no `peagle prompts` runs
           ["how do I bake  bread", "Write a haiku about rain.", "Write a haiku about rain!", "Explain tides."])
    facts = scaling.make_more_prompts(tmp_path, Path("unused-target"), 4, first, [], phrases=[])
    part = [c["messages"][0]["content"] for c in scaling.read_jsonl(tmp_path / "data" / "prompts-d.jsonl")]
    assert part == ["Write a haiku about rain.", "Explain tides."]
    assert facts["parts"] == {"d": 2} and facts["already_in_first_parts"] == 1 and facts["target_written"] == 4
    assert facts["prompt_runs"] == [{"file": "magpie-more-0.jsonl", "seed": scaling.MORE_SEED}]


def test_part_d_refuses_a_short_chunk_and_a_leak(scaling, tmp_path) -> None:
    _write(tmp_path / "data" / "magpie-more-0.jsonl", ["Explain tides."])
    with pytest.raises(SystemExit, match="holds 1 prompts where this run wants 2"):
        scaling.make_more_prompts(tmp_path, Path("unused-target"), 2, [], [], phrases=[])
    heldout = scaling.heldout_chats(1)[0]["messages"][0]["content"]
    _write(tmp_path / "data" / "magpie-more-0.jsonl", ["Explain tides.", heldout])
    with pytest.raises(SystemExit, match="leak into training"):
        scaling.make_more_prompts(tmp_path, Path("unused-target"), 2, [], [], phrases=[])
    assert not (tmp_path / "data" / "prompts-d.jsonl").exists()


def test_the_double_point_trains_on_every_part_and_needs_part_d(scaling, tmp_path) -> None:
    assert scaling.POINTS["double"] == (*scaling.POINTS["all"], "d")
    with pytest.raises(SystemExit, match="give --more-magpie-prompts"):
        scaling.main(["--work", str(tmp_path), "--points", "double"])
