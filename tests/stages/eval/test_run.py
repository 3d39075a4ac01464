"""`peagle eval` end to end on a run directory: export, offline chains, own loop, report."""

from __future__ import annotations

import json
import shutil

import pytest

from peagle.stages.eval.vllm_eval import vllm_available
from peagle.testing.tiny_draft import tiny_eval_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_llama):
    """A tiny store (HF extraction) and a run directory holding one checkpoint of a random draft."""
    root = tmp_path_factory.mktemp("eval-run")
    tiny_eval_run(root, tiny_llama, num_chats=6, samples_per_shard=3, max_seq_len=256, step=7)
    (root / "run" / "metrics.jsonl").write_text(json.dumps(
        {"kind": "train", "step": 7, "loss": 4.0, "depth_agreement": [0.1, 0.1, 0.1], "acceptance_length_estimate": 1.1})
        + "\n")
    return root / "run"


def test_cli_eval_on_a_run_directory(run_dir, tiny_llama, run_peagle):
    done = run_peagle("eval", run_dir, "--target", tiny_llama, "--mode", "offline,online", "--max-new-tokens", "8",
                      "--max-prompts", "2", "--max-samples", "4", "--quiet")
    assert done.returncode == 0, done.stderr
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert (run_dir / "eval" / "export" / "model.safetensors").is_file()  # eval measured the export
    assert report["meta"]["num_depths"] == 3 and report["meta"]["modes"] == ["offline", "online"]
    assert report["offline"]["num_samples"] == 4 and report["offline"]["num_chains"] > 0
    assert report["online"]["num_prompts"] == 2 and report["online"]["greedy_output_matches_plain"] is True
    assert "store" in report["online"]["prompt_source"]
    assert set(report["plots"]) == {"per_depth_acceptance", "acceptance_length", "training_curves", "speed"}
    one_at_a_time = report["online"]["speed"]["concurrency_1"]  # our loop decodes one request at a time
    assert one_at_a_time["concurrency"] == 1 and one_at_a_time["speedup"] == pytest.approx(
        one_at_a_time["spec_tokens_per_second"] / one_at_a_time["plain_tokens_per_second"])
    assert report["online"]["speed"]["concurrency_n"] is None
    costs, recommended = report["speed"]["step_costs"], report["speed"]["k_recommendation"]
    assert len(costs["verify_s"]) == 4 and len(costs["draft_s"]) == 3 and all(s > 0 for s in costs["step_s"])
    assert recommended["acceptance_from"] == "online" and recommended["served_k"] == 3
    assert recommended["best_k"] in (1, 2, 3) and [r["k"] for r in recommended["by_k"]] == [1, 2, 3]
    # the forwards of 2, 4 and 8 requests' steps, and from them a K per batch size (0: no drafting)
    wide = costs["batch_verify_s"]
    assert sorted(wide) == ["2", "4", "8"] and all(len(v) == 4 for v in wide.values())
    schedule = recommended["schedule"]
    assert [e["batch_size"] for e in schedule["by_batch_size"]] == [1, 2, 4, 8] and schedule["schedule"][0][0] == 1
    assert {e["k"] for e in schedule["by_batch_size"]} <= {recommended["best_k"], 0}  # P-EAGLE: its K or none
    assert f"--speculative-schedule {schedule['text']}" in done.stdout
    assert "offline" in done.stdout and "report:" in done.stdout and "one request at a time" in done.stdout


@pytest.mark.skipif(vllm_available(), reason="checks the message shown when vLLM is missing")
def test_cli_eval_vllm_mode_without_vllm_is_one_clear_line(run_dir, tiny_llama, run_peagle, tmp_path):
    done = run_peagle("eval", run_dir, "--target", tiny_llama, "--mode", "vllm", "--out", tmp_path / "r")
    assert done.returncode == 2 and "vLLM" in done.stderr and "Traceback" not in done.stderr


def test_a_draft_whose_store_is_not_here_is_still_measured(tiny_llama, run_peagle, tmp_path):
    """An export records the stores its run trained on; a draft that travelled (a committed one, a copy on
    another machine) finds none of them: what needs no store runs, what needs one is one line."""
    run = tiny_eval_run(tmp_path, tiny_llama, num_chats=4, samples_per_shard=2, max_seq_len=128, step=3)
    export = tmp_path / "export"
    assert run_peagle("export", run, "--out", export).returncode == 0
    shutil.rmtree(tmp_path / "store")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Name three colours."}]}) + "\n")
    common = ["--target", tiny_llama, "--max-new-tokens", "4", "--max-prompts", "1", "--quiet"]

    given = run_peagle("eval", export, *common, "--mode", "online", "--prompts", prompts, "--out", tmp_path / "a")
    assert given.returncode == 0, given.stderr
    assert "warning" not in given.stderr  # nothing asked of the store: nothing to say
    assert json.loads((tmp_path / "a" / "report.json").read_text())["online"]["num_prompts"] == 1

    built_in = run_peagle("eval", export, *common, "--mode", "online", "--out", tmp_path / "b")
    assert built_in.returncode == 0, built_in.stderr
    assert f"the run's store {tmp_path / 'store'} is not on this machine" in built_in.stderr

    offline = run_peagle("eval", export, *common, "--mode", "offline", "--out", tmp_path / "c")
    assert offline.returncode == 2 and "--mode offline needs a store" in offline.stderr
    named = run_peagle("eval", export, *common, "--store", tmp_path / "store", "--out", tmp_path / "d")
    assert named.returncode == 2 and "does not exist" in named.stderr
    assert "Traceback" not in offline.stderr + named.stderr


def test_a_k_above_a_p_eagle_draft_s_trained_depths_is_one_line(run_dir, tiny_llama, tmp_path):
    """The run's draft was trained at 3 depths: K = 4 is refused before anything is measured, whether
    eval exports the run or is given an export."""
    from peagle.schemas.errors import UserError
    from peagle.schemas.eval_config import EvalConfig
    from peagle.schemas.export_config import ExportConfig
    from peagle.stages.eval.run import run_eval
    from peagle.stages.export.run import run_export

    refused = r"--num-depths 4: this P-EAGLE draft was trained at 3 depths, so it serves K = 1 to 3"
    with pytest.raises(UserError, match=refused):
        run_eval(EvalConfig(source=str(run_dir), target=str(tiny_llama), num_depths=4, mode=("online",),
                            out=str(tmp_path / "from-run")))
    export = run_export(ExportConfig(source=str(run_dir), out=str(tmp_path / "export")), echo=lambda _: None)
    with pytest.raises(UserError, match=refused):
        run_eval(EvalConfig(source=str(export), target=str(tiny_llama), num_depths=4, mode=("online",),
                            out=str(tmp_path / "from-export")))
    assert not (tmp_path / "from-export" / "report.json").exists()
