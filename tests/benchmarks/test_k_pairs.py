"""benchmarks/k_pairs.py: its entries, the eval it runs per engine pair, and the summary of pairs served in
turns (the serving itself needs vLLM and SmolLM2: the benchmark's own run; `peagle eval --concurrency`
in vLLM is tests/stages/eval/test_vllm_eval.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture()
def k_pairs(load_benchmark):
    with load_benchmark("k_pairs.py") as module:
        yield module


def _report(work: Path, name: str, *, al: float, k: int, speeds: dict[int, tuple[float, float]]) -> None:
    """A report.json as `peagle eval --mode vllm --concurrency ...` writes it: per concurrency (draft, plain)
    tokens/s; the largest is every prompt at once (concurrency_n)."""
    largest = max(speeds)
    speed = {(f"concurrency_{c}" if c != largest else "concurrency_n"): {
        "concurrency": c, "spec_tokens_per_second": spec, "plain_tokens_per_second": plain, "speedup": spec / plain,
        "draft_tokens_per_draft": float(k)} for c, (spec, plain) in speeds.items()}
    (work / name).mkdir(parents=True)
    (work / name / "report.json").write_text(json.dumps({"vllm": {
        "acceptance_length": al, "num_depths": k, "settings": {"enforce_eager": False}, "speed": speed}}))


def test_two_drafts_at_their_ks_are_divided_by_the_target_alone_pooled_per_concurrency(k_pairs, tmp_path):
    _report(tmp_path, "peagle-r1", al=2.6, k=8, speeds={1: (60.0, 40.0), 4: (120.0, 100.0), 16: (150.0, 160.0)})
    _report(tmp_path, "eagle3-r1", al=2.2, k=5, speeds={1: (57.0, 30.0), 4: (110.0, 110.0), 16: (140.0, 150.0)})
    _report(tmp_path, "peagle-r2", al=2.6, k=8, speeds={1: (62.0, 41.0), 4: (118.0, 104.0), 16: (152.0, 158.0)})
    _report(tmp_path, "eagle3-r2", al=2.2, k=5, speeds={1: (58.0, 39.0), 4: (112.0, 106.0), 16: (138.0, 152.0)})
    (tmp_path / "export-peagle").mkdir()  # not a pair: ignored
    summary = k_pairs.summarise(tmp_path)
    assert summary["plain_tokens_per_second_pooled"] == {"1": pytest.approx(39.5), "4": pytest.approx(105.0),
                                                         "16": pytest.approx(155.0)}
    pe, e3 = summary["entries"]["peagle"], summary["entries"]["eagle3"]
    assert [r["round"] for r in pe["runs"]] == [1, 2] and pe["num_depths"] == 8 and e3["num_depths"] == 5
    assert list(pe["by_concurrency"]) == ["1", "4", "16"]
    assert pe["by_concurrency"]["1"]["speedup_pooled"] == pytest.approx(61.0 / 39.5)
    assert e3["by_concurrency"]["4"]["speedup_pooled"] == pytest.approx(111.0 / 105.0)
    # the pairs' own ratios put EAGLE-3 ahead one request at a time; the same target pooled puts P-EAGLE there
    assert e3["by_concurrency"]["1"]["speedup_median"] > pe["by_concurrency"]["1"]["speedup_median"]
    assert pe["by_concurrency"]["1"]["speedup_pooled"] > e3["by_concurrency"]["1"]["speedup_pooled"]
    lines = k_pairs.describe(json.loads(json.dumps(summary)))  # as read back from the JSON written
    assert lines[0] == "target alone, concurrency 1: median 39.5 tokens/s over 4 engine starts (30.0-41.0)"
    assert any(line.startswith("peagle (K = 8) at concurrency 4: AL 2.600, draft 119.0 tokens/s, 1.13x the pooled "
                               "target; pairs 1.20 / 1.13") for line in lines)


def test_entries_and_the_eval_of_one_pair(k_pairs, tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "e").mkdir()
    entries = k_pairs.parse_entries(None, [], [f"peagle={tmp_path / 'p'}:8", f"eagle3={tmp_path / 'e'}:5"],
                                    ["peagle=1:8,2-8:0"])
    assert [(e.label, e.k, e.schedule) for e in entries] == [("peagle", 8, "1:8,2-8:0"), ("eagle3", 5, None)]
    assert [e.label for e in k_pairs.parse_entries(tmp_path / "p", [4, 5], [], [])] == ["k4", "k5"]
    command = k_pairs.eval_command(tmp_path / "export-peagle", 8, target=tmp_path / "t", prompts=tmp_path / "q",
                                   out=tmp_path / "peagle-r1", concurrency=[1, 4, 8])
    assert command[command.index("--num-depths") + 1] == "8" and command[-2:] == ["--concurrency", "4,8"]
    assert "--concurrency" not in k_pairs.eval_command(tmp_path, 4, target=tmp_path, prompts=tmp_path, out=tmp_path,
                                                       concurrency=[1])
    for serves, schedules, fault in (([f"x={tmp_path / 'p'}"], [], "--serve takes LABEL=DRAFT:K"),
                                     ([f"x={tmp_path / 'p'}:0"], [], "--serve takes LABEL=DRAFT:K"),
                                     ([f"x={tmp_path / 'p'}:4", f"x={tmp_path / 'e'}:5"], [], "each label once"),
                                     ([f"x={tmp_path / 'p'}:4"], ["y=1:4"], "--schedule takes LABEL=SCHEDULE"),
                                     ([f"x={tmp_path / 'nowhere'}:4"], [], "does not exist")):
        with pytest.raises(SystemExit, match=fault):
            k_pairs.parse_entries(None, [], serves, schedules)


def test_a_work_folder_without_a_pair_is_one_line(k_pairs, tmp_path):
    with pytest.raises(SystemExit, match="no engine pair's report in"):
        k_pairs.summarise(tmp_path)
