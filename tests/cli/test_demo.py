"""`peagle demo` checks every option before it starts (issue 22): a typo is one line, and nothing ran.
Its flags are the fields of ``DemoConfig`` (issue 23), and `peagle --verbose demo` reaches every stage."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest

from peagle.schemas.demo_config import DemoConfig


@pytest.mark.parametrize("args,needle", [
    (("--eval-modes", "offline,onlin"), "--eval-modes takes a comma list of offline,online,vllm, got 'offline,onlin'"),
    (("--eval-modes", "bogus"), "--eval-modes takes a comma list of offline,online,vllm, got 'bogus'"),
    (("--hidden-dtype", "int8"), "--hidden-dtype must be one of bf16 (bfloat16), fp8 (float8), got 'int8'"),
    (("--num-depths", "0"), "--num-depths must be >= 1, got 0"),
    (("--num-train-chats", "0"), "--num-train-chats must be >= 1, got 0"),
    (("--train-steps", "-3"), "--train-steps must be >= 1, got -3"),
    (("--seed", "-1"), "--seed must be >= 0, got -1"),
    (("--method", "medusa"), "--method must be one of peagle|eagle3, got 'medusa'"),
    (("--target", "nope"), "Invalid value for '--target': Value error, 'nope' is not one of 'smollm2', 'tiny'. "
                           "See `peagle demo --help`."),
])
def test_a_bad_option_is_refused_before_anything_runs(args, needle, tmp_path, run_peagle):
    out, cache = tmp_path / "demo", tmp_path / "cache"
    proc = run_peagle("demo", "--out", out, "--cache-dir", cache, *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.strip() == f"peagle: error: {needle}"
    assert not out.exists() and not cache.exists()


def test_a_bad_value_in_a_config_file_is_refused_the_same_way(tmp_path, run_peagle):
    config = tmp_path / "demo.yaml"
    config.write_text("num-depths: 0\ntarget: tiny\n")
    out = tmp_path / "demo"
    proc = run_peagle("demo", "--config", config, "--out", out, "--cache-dir", tmp_path / "cache")
    assert (proc.returncode, proc.stdout, proc.stderr.strip()) == (2, "", "peagle: error: --num-depths must be >= 1, got 0")
    assert not out.exists()


def test_help_lists_every_config_field_as_a_flag_with_its_placeholder(run_peagle):
    proc = run_peagle("demo", "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    for field in dataclasses.fields(DemoConfig):
        flag = "--" + field.name.replace("_", "-")
        assert re.search(rf"^\s+{flag} [a-zA-Z0-9|,]+\s", proc.stdout, re.MULTILINE), (flag, proc.stdout)
    for placeholder in ("--target smollm2|tiny", "--backend auto|vllm|hf", "--method peagle|eagle3", "--out DIR",
                        "--num-depths N", "--hidden-dtype bf16|fp8", "--eval-modes offline,online,vllm"):
        assert placeholder in proc.stdout, placeholder
    assert "Run the whole pipeline on a real instruct model (or --target tiny), end to end." in proc.stdout


def test_the_root_verbose_flag_reaches_every_stage(tmp_path, run_peagle):
    """`peagle --verbose demo` runs each stage as `peagle --verbose STAGE`. A cached target that is no
    model (its directory holds an empty config.json) makes extract, the first stage after it, fail fast:
    one line naming the stage, after the stages' commands were printed."""
    cache, out = tmp_path / "cache", tmp_path / "demo"
    (cache / "targets" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    (cache / "targets" / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    proc = run_peagle("--verbose", "demo", "--out", out, "--cache-dir", cache, "--backend", "hf",
                      "--num-train-chats", "2", "--num-heldout", "1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("peagle: error: demo stage `peagle extract` failed")
    assert f"$ peagle --verbose target fetch smollm2 --cache-dir {cache}\n" in proc.stdout
    assert "$ peagle --verbose extract --data " in proc.stdout
    assert (out / "data" / "train.jsonl").read_text().count("\n") == 2


def test_demo_data_keeps_every_heldout_subject_out_of_training(tmp_path):
    """The held-out prompts (which eval decodes and the held-out store answers) share no subject
    with a training chat, so the held-out curve and the measured acceptance are on unseen subjects."""
    from peagle.cli.demo import write_demo_data
    from peagle.demo.chat_prompts import chat_prompts

    train_path, prompts_path, num_train = write_demo_data(tmp_path, "smollm2", num_train=80, num_heldout=16, seed=0)
    subject_of = {p.text: p.subject for split in ("train", "heldout") for p in chat_prompts(split=split, seed=0)}

    def subjects(path):
        return {subject_of[json.loads(line)["messages"][0]["content"]] for line in path.read_text().splitlines()}

    held = [json.loads(line)["messages"] for line in prompts_path.read_text().splitlines()]
    assert num_train == 80 and len(held) == 16 and all(len(m) == 1 and m[0]["role"] == "user" for m in held)
    assert subjects(train_path).isdisjoint(subjects(prompts_path))


TINY_DEMO = ("demo", "--target", "tiny", "--target-steps", "2", "--num-train-chats", "3", "--num-heldout", "1",
             "--train-steps", "2", "--backend", "hf", "--eval-modes", "online")


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory, run_peagle):
    """One tiny demo run (its directory, cache and process), for the tests below."""
    tmp_path = tmp_path_factory.mktemp("tiny-demo")
    out = tmp_path / "demo"
    proc = run_peagle(*TINY_DEMO, "--out", out, "--cache-dir", tmp_path / "cache", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, tmp_path / "cache", proc


@pytest.mark.slow
def test_the_tiny_demo_runs_every_stage_and_writes_its_summary(tiny_demo):
    """The demo end to end (README's first command runs the same code on SmolLM2), at the smallest
    budget: every stage runs as its own `peagle` process, prints its command and time, and the summary
    holds the store, the training and an acceptance measured in our loop with greedy output unchanged.
    The held-out prompts eval decodes are also extracted into a held-out store that train scores the
    draft on at every --eval-every: metrics.jsonl holds the held-out curve, training_curves.png draws it.
    What a demo draft accepts is benchmarks/results/cpu/demo_summary.json's business, not this test's."""
    out, _, proc = tiny_demo
    assert "committed" not in json.loads((out / "summary.json").read_text())  # none committed for the tiny target
    for stage in ("extract", "vocab", "train", "export", "eval"):
        assert f"\n$ peagle {stage} " in proc.stdout and f"[demo] {stage}: " in proc.stdout, stage
    assert f"--out {out / 'heldout-store'} " in proc.stdout and "[demo] extract held-out: " in proc.stdout
    assert f"--eval-store {out / 'heldout-store'} --eval-every 1" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["store"]["samples"] == 3 and summary["train"]["steps"] == 2
    assert summary["heldout_store"]["samples"] == 1  # exactly the prompts eval decodes
    assert summary["eval"]["meta"]["settings"]["prompts"] == str(out / "data" / "heldout_prompts.jsonl")
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    heldout = [m for m in metrics if m["kind"] == "eval"]
    assert [m["step"] for m in heldout] == [1, 2] and all(m["acceptance_length_estimate"] >= 1.0 for m in heldout)
    assert summary["estimates"]["heldout_prompts"] == heldout[-1]["acceptance_length_estimate"]
    assert summary["train"]["num_heldout_points"] == 2 and summary["estimates"]["training_batches"] >= 1.0
    assert summary["eval"]["plots"]["training_curves"] == "training_curves.png"
    assert (out / "report" / "training_curves.png").stat().st_size > 0
    online = summary["eval"]["online"]
    assert online["acceptance_length"] >= 1.0 and online["greedy_output_matches_plain"]
    assert "peagle demo summary" in proc.stdout and "online       acceptance length" in proc.stdout
    assert "estimates    acceptance length " in proc.stdout and " on held-out prompts" in proc.stdout
    assert online["speed"]["concurrency_1"]["speedup"] > 0 and "one request at a time: " in proc.stdout
    assert summary["eval"]["speed"]["k_recommendation"]["best_k"] in (1, 2, 3, 4, 5) and "predicted fastest" in proc.stdout


@pytest.mark.slow
def test_the_demo_run_again_serves_a_committed_draft_beside_its_own_and_keeps_its_data(tiny_demo, run_peagle,
                                                                                        tmp_path):
    """A draft that travelled without the target's embedding (trained with a frozen embedding on a copy of
    the demo's store, since deleted, exported --without-target-embedding, described by draft.json) is
    made whole with the demo's target and measured on the same held-out prompts; the summary carries both.

    That second demo runs into the first's directory (one run for two checks, ~70 s of CI): the first run
    (the fixture's) trained the demo target, this one finds it cached, so the two processes import
    different things before writing the chats, and the chats must not care (they once did, and the second
    run's extract refused the store the first had written for other inputs). Last in this file: it runs
    into the fixture's directory."""
    out, cache, first_proc = tiny_demo
    first_chats = (out / "data" / "train.jsonl").read_bytes()
    assert "training the demo target" in first_proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    target = summary["target"]["path"]
    elsewhere = tmp_path / "store"  # where it trained, gone by the time it is served (as on a newcomer's machine)
    shutil.copytree(out / "store", elsewhere)
    trained = run_peagle("train", "--store", elsewhere, "--target", target, "--out", tmp_path / "run", "--num-layers",
                         "1", "--num-depths", "2", "--draft-vocab-size", "512", "--max-steps", "2", "--token-budget",
                         "512", "--no-train-embeddings", "--num-workers", "0", "--heldout-fraction", "0")
    assert trained.returncode == 0, trained.stderr[-2000:]
    committed = tmp_path / "drafts" / "longer"
    exported = run_peagle("export", tmp_path / "run", "--out", committed, "--without-target-embedding")
    assert exported.returncode == 0, exported.stderr
    (committed / "draft.json").write_text(json.dumps({"target": "tiny", "method": "peagle", "num_depths": 2,
                                                      "serve_k": 1, "acceptance_length": 1.0, "trained": {"steps": 2}}))
    shutil.rmtree(elsewhere)
    proc = run_peagle(*TINY_DEMO, "--out", out, "--cache-dir", cache, "--committed-draft", committed, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "training the demo target" not in proc.stdout  # cached the second time
    assert (out / "data" / "train.jsonl").read_bytes() == first_chats
    assert f"$ peagle export {committed} --target {target} --out {out / 'export-committed'}" in proc.stdout
    both = json.loads((out / "summary.json").read_text())
    mine, theirs = both["eval"], both["committed"]["eval"]
    # served at its serve_k, on the demo's own prompts
    assert theirs["meta"]["num_depths"] == 1 and theirs["meta"]["settings"]["prompts"] == mine["meta"]["settings"]["prompts"]
    assert theirs["online"]["greedy_output_matches_plain"] and theirs["online"]["speed"]["concurrency_1"]["speedup"] > 0
    assert "committed    longer: peagle, trained 2 steps" in proc.stdout and "online at K = 1:" in proc.stdout
    broken = tmp_path / "broken"
    broken.mkdir()
    refused = run_peagle(*TINY_DEMO, "--out", tmp_path / "refused", "--cache-dir", cache, "--committed-draft", broken)
    assert refused.returncode == 2 and "draft.json" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "refused" / "data").exists()  # refused before any stage ran
