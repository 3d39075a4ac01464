"""What the trackers are sent (peagle/pipeline/tracking/scalars.py): every number of a metrics.jsonl line
under its group, the acceptance-length estimates named as estimates beside the measured ones, and a
config flattened into hyperparameters."""

from __future__ import annotations

import math

from peagle.pipeline.tracking.scalars import flat_params, record_scalars, report_scalars


def test_a_training_line_becomes_one_tag_per_number_and_per_depth():
    record = {"kind": "train", "step": 10, "loss": 2.5, "depth_agreement": [0.5, None, 0.25], "depth_count": [4, 3, 2],
              "acceptance_length_estimate": 1.75, "lr": 1e-4, "grad_norm": None, "bad_steps": 0,
              "tokens_per_s": 1234.5, "data_wait_share": 0.1, "epoch": 0, "memory_allocated_gib": 1.5}
    assert record_scalars(record) == {
        "train/loss": 2.5, "train/depth_agreement/depth_0": 0.5, "train/depth_agreement/depth_2": 0.25,
        "train/depth_count/depth_0": 4.0, "train/depth_count/depth_1": 3.0, "train/depth_count/depth_2": 2.0,
        "acceptance_length/estimate_on_training_batches": 1.75, "train/lr": 1e-4, "train/bad_steps": 0.0,
        "train/tokens_per_s": 1234.5, "train/data_wait_share": 0.1, "train/epoch": 0.0,
        "train/memory_allocated_gib": 1.5}


def test_an_eval_line_is_the_held_out_estimate_and_non_finite_values_are_left_out():
    record = {"kind": "eval", "step": 3, "loss": math.nan, "acceptance_length_estimate": 1.2, "num_no_target": 2,
              "flag": True}
    assert record_scalars(record) == {"acceptance_length/estimate_on_held_out": 1.2, "held_out/num_no_target": 2.0}
    assert record_scalars({"kind": "other", "step": 1, "x": 1.0}) == {}


def test_a_report_gives_the_measured_acceptance_length_of_each_mode_beside_the_estimates():
    report = {"offline": {"acceptance_length": 2.0, "per_depth_acceptance": [0.8, 0.2]},
              "online": {"acceptance_length": 1.9, "per_depth_acceptance": [0.7, None], "tokens_per_target_forward": 1.8,
                         "speed": {"concurrency_1": {"spec_tokens_per_second": 30.0, "plain_tokens_per_second": 20.0,
                                                     "speedup": 1.5}, "concurrency_n": None}},
              "vllm": None, "server": {"acceptance_length": 1.8, "spec_tokens_per_second": 50.0},
              "comparison": {"online_vs_vllm_relative_difference": None, "server_vs_online_relative_difference": 0.05}}
    assert report_scalars(report) == {
        "acceptance_length/measured_offline_chains": 2.0, "measured/offline/acceptance_depth_1": 0.8,
        "measured/offline/acceptance_depth_2": 0.2, "acceptance_length/measured_own_loop": 1.9,
        "measured/online/acceptance_depth_1": 0.7, "measured/online/tokens_per_target_forward": 1.8,
        "measured/online/tokens_per_s_with_draft_concurrency_1": 30.0,
        "measured/online/tokens_per_s_without_draft_concurrency_1": 20.0,
        "measured/online/speedup_concurrency_1": 1.5, "acceptance_length/measured_vllm_server": 1.8,
        "measured/server/tokens_per_s_with_draft": 50.0, "measured/server_vs_online_relative_difference": 0.05}


def test_a_config_flattens_into_values_every_backend_takes():
    assert flat_params({"lr": 0.1, "store": ["a", "b:0.5"], "max_steps": None, "fsdp": False,
                        "nested": {"k": 3, "deeper": {"x": "y"}}}) == {
        "lr": 0.1, "store": "a,b:0.5", "max_steps": "none", "fsdp": False, "nested.k": 3, "nested.deeper.x": "y"}


def test_every_concurrency_eval_timed_is_sent():
    """`peagle eval --concurrency 4` adds vLLM's figures in waves of 4 beside one request and every prompt at once."""
    figures = {"spec_tokens_per_second": 90.0, "plain_tokens_per_second": 100.0, "speedup": 0.9}
    report = {"vllm": {"speed": {"concurrency_1": None, "concurrency_4": figures, "concurrency_n": None}}}
    assert report_scalars(report) == {"measured/vllm/tokens_per_s_with_draft_concurrency_4": 90.0,
                                      "measured/vllm/tokens_per_s_without_draft_concurrency_4": 100.0,
                                      "measured/vllm/speedup_concurrency_4": 0.9}
