"""benchmarks/k_pairs.py: the summary of engine pairs served in turns (the serving itself needs vLLM
and SmolLM2: the benchmark's own run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture()
def k_pairs(load_benchmark):
    with load_benchmark("k_pairs.py") as module:
        yield module


def _report(work: Path, name: str, *, al: float, spec: float, plain: float) -> None:
    (work / name).mkdir(parents=True)
    (work / name / "report.json").write_text(json.dumps({"vllm": {
        "acceptance_length": al, "settings": {"enforce_eager": False},
        "speed": {"concurrency_1": {"spec_tokens_per_second": spec, "plain_tokens_per_second": plain,
                                    "speedup": spec / plain}}}}))


def test_every_k_is_divided_by_the_target_alone_pooled_over_every_pair(k_pairs, tmp_path):
    _report(tmp_path, "k4-r1", al=2.0, spec=60.0, plain=40.0)
    _report(tmp_path, "k5-r1", al=2.1, spec=57.0, plain=30.0)  # a slow start of the target alone flatters K = 5
    _report(tmp_path, "k4-r2", al=2.0, spec=62.0, plain=41.0)
    _report(tmp_path, "k5-r2", al=2.1, spec=58.0, plain=39.0)
    _report(tmp_path, "k5", al=9.9, spec=1.0, plain=1.0)  # not a pair of this script's: ignored
    summary = k_pairs.summarise(tmp_path)
    assert summary["plain_tokens_per_second_pooled"] == pytest.approx(39.5)
    four, five = summary["by_k"]["4"], summary["by_k"]["5"]
    assert [r["round"] for r in four["runs"]] == [1, 2] and four["spec_tokens_per_second_median"] == 61.0
    assert four["speedup_pooled"] == pytest.approx(61.0 / 39.5) and five["speedup_pooled"] == pytest.approx(57.5 / 39.5)
    # the pairs' own ratios put K = 5 ahead; the same target pooled puts K = 4 there
    assert five["speedup_median"] > four["speedup_median"] and four["speedup_pooled"] > five["speedup_pooled"]
    lines = k_pairs.describe(summary)
    assert lines[0] == "target alone: median 39.5 tokens/s over 4 engine starts (30.0-41.0)"
    assert lines[1].startswith("K = 4: AL 2.000, draft 61.0 tokens/s, 1.54x the pooled target; pairs 1.50 / 1.51")


def test_a_work_folder_without_a_pair_is_one_line(k_pairs, tmp_path):
    with pytest.raises(SystemExit, match="no engine pair's report in"):
        k_pairs.summarise(tmp_path)
