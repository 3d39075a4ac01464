"""benchmarks/convergence.py: the train command of a long run (parts weighted by their samples, the
method's own flags, checkpoints to serve), and the record it reads back from a run's files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest


@pytest.fixture()
def convergence(load_benchmark):
    with load_benchmark("convergence.py") as module:
        yield module


def _store(path: Path, records: int) -> None:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"num_records": records, "num_tokens": 10 * records}))


def _args(work: Path, method: str) -> argparse.Namespace:
    return argparse.Namespace(work=work, points="all", method=method, steps=5000, serve_every=500, extra="")


def test_the_parts_are_weighted_by_their_samples_and_each_method_gets_its_flags(convergence, tmp_path):
    for part, records in (("a", 100), ("b", 100), ("c", 200)):
        _store(tmp_path / "stores" / part, records)
    peagle = convergence.train_args(_args(tmp_path, "peagle"), Path("/t"), Path("/r"))
    stores = [peagle[i + 1] for i, word in enumerate(peagle) if word == "--store"]
    assert stores == [f"{tmp_path}/stores/a:100", f"{tmp_path}/stores/b:100", f"{tmp_path}/stores/c:200"]
    flags = dict(zip(peagle[1::2], peagle[2::2]))
    assert flags["--max-steps"] == "5000" and flags["--save-every"] == "500" and flags["--seed"] == "0"
    assert "--no-train-embeddings" in peagle and "--max-anchors" in peagle  # it travels; COD as BASE
    assert peagle.count("--save-every") == 1
    eagle3 = convergence.train_args(_args(tmp_path, "eagle3"), Path("/t"), Path("/r"))
    assert "--max-anchors" not in eagle3 and "--no-train-embeddings" in eagle3
    wider = convergence.train_args(argparse.Namespace(**{**vars(_args(tmp_path, "peagle")), "extra": "--token-budget 4096"}),
                                   Path("/t"), Path("/r"))
    assert wider.count("--token-budget") == 1 and wider[wider.index("--token-budget") + 1] == "4096"


def test_committed_commands_name_work_and_target_not_this_machine(convergence, tmp_path):
    command = (f"peagle train --store {tmp_path}/stores/a:10 --target /cache/targets/SmolLM2 --out "
               f"{tmp_path}/convergence/x/run --eval-store {tmp_path}/stores/heldout")
    assert convergence.with_placeholders(command, tmp_path) == (
        "peagle train --store WORK/stores/a:10 --target TARGET --out WORK/convergence/x/run --eval-store WORK/stores/heldout")
    assert convergence.with_placeholders("peagle export WORK/ckpt --out DIR", tmp_path) == "peagle export WORK/ckpt --out DIR"


def test_the_record_reads_the_curve_and_the_served_checkpoints_with_their_epochs(convergence, tmp_path):
    home = tmp_path / "convergence" / "peagle-all"
    (home / "run").mkdir(parents=True)
    (home / "command.txt").write_text("peagle train ...\n")
    (home / "train.log").write_text("peagle: draft ...; 250 batches/epoch/rank, 5000 steps\n")
    (home / "run" / "metrics.jsonl").write_text(json.dumps(
        {"kind": "eval", "step": 500, "acceptance_length_estimate": 1.7, "loss": 1.5, "depth_agreement": [0.5]}) + "\n")
    for step, al in ((500, 1.61), (1000, 1.72)):
        report = home / "served" / f"step-{step:08d}" / "report" / "report.json"
        report.parent.mkdir(parents=True)
        report.write_text(json.dumps({"vllm": {"acceptance_length": al, "speed": {"concurrency_1": {"speedup": 1.1}}}}))
    found = convergence.record(home, tmp_path)
    assert found["batches_per_epoch"] == 250 and found["command"] == "peagle train ..."
    assert [(s["step"], s["epochs"], s["acceptance_length"]) for s in found["served"]] == [(500, 2.0, 1.61),
                                                                                          (1000, 4.0, 1.72)]
    assert found["curve"][0]["al_estimate"] == 1.7


def test_a_k_check_gives_the_committed_draft_its_serve_k_only_when_that_k_was_served(convergence):
    check = {"recommendation": {"best_k": 3},
             "served": {"3": {"acceptance_length": 1.65, "speed": {"concurrency_1": {"speedup": 1.4}}},
                        "5": {"acceptance_length": 1.66, "speed": {"concurrency_1": {"speedup": 1.2}}}},
             "predicted_vs_measured_c1": [{"k": 3, "predicted": 1.27, "measured": 1.4}]}
    facts = convergence.serve_k_facts(check)
    assert facts["serve_k"] == 3 and facts["at_serve_k"]["speed"]["concurrency_1"]["speedup"] == 1.4
    assert facts["k_check"] == check["predicted_vs_measured_c1"]
    assert facts["at_serve_k"]["vllm_engines"] is None  # a check from before the engines were recorded
    check["served"]["3"].update(enforce_eager=False, speedup_c1_runs=[1.4, 1.3, 1.5], speedup_c1_median=1.4)
    at = convergence.serve_k_facts(check)["at_serve_k"]
    assert at["vllm_engines"] == "compiled" and at["speedup_c1_runs"] == [1.4, 1.3, 1.5] and at["speedup_c1_median"] == 1.4
    del check["served"]["3"]
    with pytest.raises(SystemExit, match="recommends K = 3 but did not serve it"):
        convergence.serve_k_facts(check)


def test_the_plot_draws_every_run_even_one_not_yet_served(convergence, tmp_path):
    runs = [{"name": "peagle-half", "batches_per_epoch": 162,
             "curve": [{"step": 25, "al_estimate": 1.2}, {"step": 600, "al_estimate": 1.78}],
             "served": [{"step": 600, "acceptance_length": 1.65, "speed": {"concurrency_1": {"speedup": 1.41}}}]},
            {"name": "eagle3-half", "batches_per_epoch": None, "curve": [{"step": 25, "al_estimate": 1.2}], "served": []}]
    out = tmp_path / "convergence.png"
    convergence.plot(runs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not out.with_name(out.name + ".tmp").exists()
    many = [{**runs[0], "name": f"run-{i}"} for i in range(6)]  # more runs than a palette of four
    lines = convergence.figure_of(many).axes[0].get_lines()
    assert sorted({line.get_label().split(":")[0] for line in lines}) == [f"run-{i}" for i in range(6)]
    assert len({line.get_color() for line in lines}) == 6
