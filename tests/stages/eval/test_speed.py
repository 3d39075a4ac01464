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
