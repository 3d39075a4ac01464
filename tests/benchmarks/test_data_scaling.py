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


def test_supervised_tokens_count_a_store_made_over_several_runs(scaling, tmp_path, tiny_llama) -> None:
    """A store two runs made (here two workers, one after the other) counts every committed shard's answer
    tokens, as a store one run made does; a store with nothing committed counts None."""
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.testing.chat_data import write_chat_jsonl

    data = write_chat_jsonl(tmp_path / "chat.jsonl", 18, seed=5)

    def extract(out: Path, **worker) -> None:
        run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(out), samples_per_shard=6,
                                  backend="hf", device="cpu", max_seq_len=128, **worker),
                    echo=lambda _: None, progress=False)

    assert scaling.supervised_tokens(tmp_path / "none") is None
    extract(tmp_path / "whole")
    extract(tmp_path / "parts", shard_index=0, num_shards=2)
    first = scaling.supervised_tokens(tmp_path / "parts")
    extract(tmp_path / "parts", shard_index=1, num_shards=2)
    whole = scaling.supervised_tokens(tmp_path / "whole")
    assert 0 < first < whole
    assert scaling.supervised_tokens(tmp_path / "parts") == whole
