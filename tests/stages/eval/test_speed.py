"""The speed figures, the break-even acceptance length and the K recommendation from given costs."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from peagle.stages.eval.speed import StepCosts, fitted_line, k_recommendation, recommend_k, speed_figures


def costs(verify_ms: list[float], draft_ms: list[float], bookkeeping_ms: float = 1.0, pick_ms: float = 0.0) -> StepCosts:
    return StepCosts(context=256, verify_s=[v / 1e3 for v in verify_ms], draft_s=[d / 1e3 for d in draft_ms],
                     bookkeeping_s=bookkeeping_ms / 1e3, pick_s=pick_ms / 1e3)


def test_break_even_is_the_step_over_the_plain_step():
    c = costs([10, 11, 12, 13], [5, 5, 5], bookkeeping_ms=1)
    assert c.plain_s == pytest.approx(0.010)
    assert c.step_s(1) == pytest.approx(0.011 + 0.005 + 0.001)  # verify 2 tokens + draft K=1 + bookkeeping
    assert [round(b, 3) for b in c.to_dict()["break_even_acceptance_length"]] == [1.7, 1.8, 1.9]


def test_a_flat_step_cost_serves_every_depth_a_rising_one_serves_few():
    acceptance = [0.6, 0.3, 0.1, 0.02, 0.01]
    parallel = costs([10] * 6, [5] * 5)  # P-EAGLE: one draft forward whatever K
    assert recommend_k(acceptance, parallel)["best_k"] == 5
    sequential = costs([10] * 6, [5 * k for k in range(1, 6)])  # EAGLE-3: K draft forwards
    found = recommend_k(acceptance, sequential)
    assert found["best_k"] == 1
    assert found["predicted_speedup"] == pytest.approx(1.6 / 1.6)


def test_a_draft_below_break_even_is_predicted_slower():
    found = recommend_k([0.2, 0.05], costs([10, 10, 10], [5, 5]))
    # 1.2 tokens (K = 1) or 1.25 (K = 2) for the cost of 1.6 plain steps: slower at every K
    assert found["best_k"] == 2 and found["predicted_speedup"] == pytest.approx(1.25 / 1.6)


@given(acceptance=st.lists(st.floats(0, 1), min_size=1, max_size=8),
       verify=st.lists(st.floats(1, 100), min_size=9, max_size=9),
       draft=st.lists(st.floats(0.1, 100), min_size=8, max_size=8))
def test_the_recommendation_is_the_argmax_of_predicted_speed(acceptance, verify, draft):
    acceptance = sorted(acceptance, reverse=True)  # P(a >= d) falls with d
    c = costs(verify, draft)
    found = recommend_k(acceptance, c)
    fitted = c.fitted_step_s()
    predicted = {row["k"]: (1 + sum(acceptance[: row["k"]])) * c.plain_s / fitted[row["k"] - 1] for row in found["by_k"]}
    assert [row["k"] for row in found["by_k"]] == list(range(1, len(acceptance) + 1))
    assert predicted[found["best_k"]] == pytest.approx(max(predicted.values()))
    for row in found["by_k"]:
        assert row["predicted_speedup"] == pytest.approx(predicted[row["k"]])


@given(intercept=st.floats(0.1, 100), slope=st.floats(0, 10), n=st.integers(1, 8))
def test_the_line_through_costs_that_are_affine_in_k_is_the_costs(intercept, slope, n):
    values = [intercept + slope * k for k in range(1, n + 1)]
    assert fitted_line(values) == pytest.approx(values, rel=1e-9, abs=1e-9)


@given(values=st.lists(st.floats(0.1, 100), min_size=1, max_size=8))
def test_the_line_keeps_the_mean_and_never_falls(values):
    line = fitted_line(values)
    assert sum(line) / len(line) == pytest.approx(sum(values) / len(values), rel=1e-9)
    assert all(b >= a - 1e-9 for a, b in zip(line, line[1:]))


def test_one_mistimed_k_no_longer_picks_the_k():
    """The demo's timed break-even ALs (1.47 1.75 1.40 1.35 1.54 for K = 1..5, a P-EAGLE draft whose
    step barely grows with K): K = 4 was picked by noise alone; on the line (flat: the timed slope is
    below zero) every K costs the same, and the acceptance decides."""
    timed = [1.47, 1.75, 1.40, 1.35, 1.54]
    c = costs([10.0] + [10.0 * b - 1.0 for b in timed], [0.0] * 5, bookkeeping_ms=1.0)  # plain 10 ms
    assert [round(b, 2) for b in c.to_dict()["break_even_acceptance_length"]] == timed
    acceptance = [0.31, 0.03, 0.01, 0.005, 0.002]  # the demo's draft
    found = recommend_k(acceptance, c)
    assert [round(r["timed_break_even_acceptance_length"], 2) for r in found["by_k"]] == timed
    timed_best = max(range(1, 6), key=lambda k: (1 + sum(acceptance[:k])) / timed[k - 1])
    assert timed_best == 4 and found["best_k"] == 5
    line = [r["break_even_acceptance_length"] for r in found["by_k"]]
    assert line == pytest.approx([sum(timed) / 5] * 5)


def test_the_recommendation_reads_what_vllm_served_first_and_compares_with_the_served_k():
    c = costs([10] * 6, [5 * k for k in range(1, 6)])
    sections = {"online": {"per_depth_acceptance": [0.9, 0.9, 0.9, 0.9, 0.9]},
                "vllm": {"per_depth_acceptance": [0.6, 0.3, 0.1, 0.02, 0.01]}}
    found = k_recommendation(sections, c, served_k=5)
    assert found["acceptance_from"] == "vllm" and found["best_k"] == 1 and found["served_k"] == 5
    assert found["predicted_gain_over_served_k"] == pytest.approx(1.0 / (2.03 / 3.6))
    assert k_recommendation({"online": {"per_depth_acceptance": [float("nan")]}}, c, served_k=1)["best_k"] is None


def test_speed_figures_without_a_plain_run_have_no_ratio():
    assert speed_figures(concurrency=8, spec_tokens=100, spec_seconds=2.0) == {
        "concurrency": 8, "spec_tokens_per_second": 50.0, "plain_tokens_per_second": None, "speedup": None,
        "spec_seconds": 2.0, "plain_seconds": None}
    assert speed_figures(concurrency=1, spec_tokens=100, spec_seconds=2.0, plain_tokens=100,
                         plain_seconds=4.0)["speedup"] == pytest.approx(2.0)


def test_what_the_served_k_measured_sets_the_level_of_the_prediction():
    c = costs([10] * 6, [5] * 5)  # flat: K = 5 predicted fastest
    sections = {"vllm": {"per_depth_acceptance": [0.6, 0.3, 0.1, 0.02, 0.01],
                         "speed": {"concurrency_1": {"speedup": 1.5}}}}
    found = k_recommendation(sections, c, served_k=3)
    served = next(row for row in found["by_k"] if row["k"] == 3)
    assert served["calibrated_speedup"] == pytest.approx(1.5) and found["best_k"] == 5
    assert found["calibrated_speedup"] == pytest.approx(1.5 * found["predicted_speedup"] / served["predicted_speedup"])


class DriftingMachine:
    """A fake clock and parts whose cost is their own plus a slow start: the first ``slow_calls``
    calls of any part take ``extra`` longer (a machine that just prefilled)."""

    def __init__(self, slow_calls: int, extra: float):
        self.now, self.calls, self.slow_calls, self.extra = 0.0, 0, slow_calls, extra

    def clock(self) -> float:
        return self.now

    def part(self, cost: float):
        def run() -> None:
            self.now += cost + (self.extra if self.calls < self.slow_calls else 0.0)
            self.calls += 1
        return run


@given(costs_ms=st.lists(st.floats(1, 100), min_size=2, max_size=9), slow_calls=st.integers(0, 30))
def test_a_slow_start_does_not_land_on_whichever_part_is_timed_first(costs_ms, slow_calls):
    """Timed in turns after warm-up rounds, each median is the part's own cost however long the
    machine's slow start lasts (within the warm-up and half the timed rounds); timed one part after
    the other, the first part's median would carry the slow start alone."""
    from peagle.stages.eval.speed import interleaved_medians

    machine = DriftingMachine(slow_calls=min(slow_calls, 4 * len(costs_ms)), extra=500.0)  # warm-up + 2 rounds
    medians = interleaved_medians([machine.part(c) for c in costs_ms], repeats=5, warmup=2, clock=machine.clock)
    assert medians == pytest.approx(costs_ms)


def batch_costs(max_depths: int, *, fixed_ms: float, per_token_ms: float, draft_ms: float,
                batch_sizes=(2, 4, 8)) -> StepCosts:
    """A target forward of ``fixed + per_token · n`` ms over n new tokens, a flat draft (P-EAGLE's one forward)."""
    def forward(n: int) -> float:
        return (fixed_ms + per_token_ms * n) / 1e3

    return StepCosts(context=256, verify_s=[forward(n) for n in range(1, max_depths + 2)],
                     draft_s=[draft_ms / 1e3] * max_depths, bookkeeping_s=0.0, pick_s=0.0,
                     batch_verify_s={b: [forward(b * (k + 1)) for k in range(max_depths + 1)] for b in batch_sizes})


ACCEPTANCE_8 = [0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1]


def test_the_k_per_batch_size_drafts_less_where_a_forward_costs_its_tokens():
    """One request at a time a forward is its fixed part and K = 8 pays; at 8 requests it is 8·(K + 1)
    tokens of work, where drafting costs more than it gains: no drafting there (K = 0)."""
    from peagle.stages.eval.speed import speculation_schedule

    c = batch_costs(8, fixed_ms=20, per_token_ms=4, draft_ms=2)
    assert c.batch_plain_s(8) == pytest.approx(0.052) and c.fitted_batch_step_s(1) == pytest.approx(c.fitted_step_s())
    assert c.fitted_batch_step_s(4)[1] == pytest.approx((20 + 4 * 4 * 3 + 4 * 2) / 1e3)  # 12 tokens, 4 proposals
    found = speculation_schedule(ACCEPTANCE_8, c, parallel=False, served_k=8)
    by_batch = {e["batch_size"]: e for e in found["by_batch_size"]}
    assert [r["k"] for r in by_batch[1]["by_k"]] == list(range(1, 9))  # every K up to the draft's 8
    assert by_batch[1]["k"] == max(by_batch[1]["by_k"], key=lambda r: r["predicted_speedup"])["k"] == 4
    assert 0 < by_batch[2]["k"] < by_batch[1]["k"] and by_batch[8]["k"] == 0
    assert found["schedule"][0][:2] == [1, 1] and found["schedule"][-1] == [8, 8, 0]
    assert found["speculative_tokens"] == by_batch[1]["k"] and found["text"].endswith("8:0")
    # P-EAGLE: the best K alone, or none, at every batch size (what vLLM 0.32 serves right)
    parallel = speculation_schedule(ACCEPTANCE_8, c, parallel=True, served_k=8)
    assert {e["k"] for e in parallel["by_batch_size"]} <= {by_batch[1]["k"], 0}
    assert parallel["by_batch_size"][-1]["k"] == 0


def test_what_vllm_measured_at_a_concurrency_sets_that_batch_size_s_level():
    """Our loop predicts drafting pays a little at 4 requests; vLLM measured K = 8 there at 0.8x the
    target alone: read at that level, no K pays at 4."""
    from peagle.stages.eval.speed import speculation_schedule

    c = batch_costs(8, fixed_ms=40, per_token_ms=1, draft_ms=2)
    alone = speculation_schedule(ACCEPTANCE_8, c, parallel=True, served_k=8)
    assert next(e for e in alone["by_batch_size"] if e["batch_size"] == 4)["k"] == 8
    sections = {"vllm": {"per_depth_acceptance": ACCEPTANCE_8, "speed": {
        "concurrency_1": {"concurrency": 1, "speedup": 1.6, "draft_tokens_per_draft": 8.0},
        "concurrency_4": {"concurrency": 4, "speedup": 0.8, "draft_tokens_per_draft": 8.0},
        "concurrency_8": {"concurrency": 8, "speedup": 1.9, "draft_tokens_per_draft": 0.0}}}}  # another K: not read
    found = k_recommendation(sections, c, served_k=8, parallel=True)["schedule"]
    four, eight = (next(e for e in found["by_batch_size"] if e["batch_size"] == b) for b in (4, 8))
    assert four["measured_speedup_at_served_k"] == 0.8 and four["k"] == 0
    assert next(r for r in four["by_k"] if r["k"] == 8)["calibrated_speedup"] == pytest.approx(0.8)
    assert eight["measured_speedup_at_served_k"] is None


def test_step_costs_are_timed_for_every_k_up_to_8_and_every_batch_size(tiny_llama):
    """The real parts (the HF target, a P-EAGLE draft of 8 depths): K = 1..8 one request at a time, and a
    forward over b·(k + 1) tokens for k = 0..8 at each batch size asked."""
    import sys
    from pathlib import Path

    from peagle.stages.eval.online import HFTarget, proposer_drafter
    from peagle.stages.eval.speed import measure_step_costs

    sys.path.insert(0, str(Path(__file__).parents[2] / "model"))
    from test_speculators_format import tiny_draft

    draft = tiny_draft(tiny_llama)
    target = HFTarget.load(str(tiny_llama), draft.config.aux_layer_ids)
    c = measure_step_costs(target, proposer_drafter(draft, target.vocab_size), list(range(10, 40)), max_depths=8,
                           context=64, repeats=1, batch_sizes=(1, 2, 4))
    assert c.max_depths == 8 and len(c.verify_s) == 9 and sorted(c.batch_verify_s) == [2, 4]
    assert all(len(v) == 9 and all(s > 0 for s in v) for v in c.batch_verify_s.values())
    report = c.to_dict()
    assert len(report["fitted_step_s"]) == 8 and len(report["batches"]["4"]["fitted_step_s"]) == 8
