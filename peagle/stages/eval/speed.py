"""How fast decoding runs with and without the draft, what one speculative step costs on this
machine, and the K that makes the most tokens per second.

:func:`speed_figures` is the one shape every mode reports its speed in: tokens/s with the draft and
without it, and their ratio, at a concurrency (1: one request at a time, the headline; N: all the
prompts at once, what a shared server sees).

Speculative decoding is a latency tool: one request at a time, a plain step is one target forward
for one token, and a speculative step is the draft's proposal of K tokens plus one target forward
that verifies K + 1. Whether a draft pays is then a ratio of costs, not of forwards:

    tokens/s with the draft   AL(K) · t_plain
    ----------------------- = ------------------------------------------,   AL(K) = 1 + Σ_{d<=K} P(a >= d)
    tokens/s without          t_verify(K + 1) + t_draft(K) + t_bookkeeping

so the **break-even acceptance length** at K is ``t_step(K) / t_plain``: a draft whose AL(K) is
below it makes decoding slower whatever its AL looks like. :func:`measure_step_costs` times each
term in our own loop (:mod:`.online`) at one context length, medians of a few rounds timed in
turns after warm-up rounds (:func:`interleaved_medians`); :func:`recommend_k` reads the per-depth
acceptance a draft was measured at (depth d's draft never depends on how many drafts follow it, so
AL(k) for every k <= K comes from the same steps: :mod:`.acceptance`) and predicts tokens/s at each
K from these costs, smoothed by a line over K (:meth:`StepCosts.fitted_step_s`).

vLLM's costs per K are not timed here (one engine start per K); benchmarks/step_cost.py times both
loops at every K and docs/performance.md compares the two.

**A K per batch size.** With b requests in flight a step verifies b·(K + 1) tokens in one target
forward and drafts for b requests, while a plain step is one forward over b tokens; on a few CPU
cores a forward's cost grows with its tokens, so the K that pays at b = 1 may not pay at b = 8.
:func:`measure_step_costs` also times the target forward over b·(k + 1) new tokens for each batch
size of :data:`SCHEDULE_BATCH_SIZES` (one sequence at the same context: the same matrix products as b
requests, one context's attention instead of b; on a small target the weights dominate) and
:func:`speculation_schedule` predicts, per batch size, the K with the most tokens per second, or no
drafting where none pays: the schedule vLLM takes as ``num_speculative_tokens_per_batch_size``
(peagle/schemas/speculative_schedule.py). Drafting b requests is costed as b proposals of one (vLLM
drafts the batch in one forward, so this is an upper bound).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from peagle.schemas.speculative_schedule import schedule_text
from peagle.stages.eval.acceptance import acceptance_lengths
from peagle.stages.eval.online import (DecodeState, Drafter, Sampler, TargetLM, accept_greedy, commit, prefill,
                                       propose, verify)

def speed_figures(*, concurrency: int, spec_tokens: int, spec_seconds: float, plain_tokens: int | None = None,
                  plain_seconds: float | None = None) -> dict[str, Any]:
    """Tokens/s with the draft, without it (when plain decoding ran) and their ratio, at ``concurrency``
    requests in flight."""
    spec = spec_tokens / spec_seconds if spec_seconds else None
    plain = plain_tokens / plain_seconds if plain_seconds and plain_tokens is not None else None
    return {"concurrency": concurrency, "spec_tokens_per_second": spec, "plain_tokens_per_second": plain,
            "speedup": spec / plain if spec and plain else None, "spec_seconds": spec_seconds,
            "plain_seconds": plain_seconds}


DEFAULT_CONTEXT = 256
"""Tokens of context the costs are timed at: a chat prompt and a few hundred tokens of answer."""

SCHEDULE_BATCH_SIZES = (1, 2, 4, 8)
"""Batch sizes the K schedule is costed at (one request at a time, and 4 and 8 at once, what
benchmarks/k_pairs.py serves); vLLM carries the last one's K on to larger batches."""


def interleaved_medians(fns: list[Callable[[], Any]], *, repeats: int, warmup: int = 2,
                        clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The median wall time of each of ``fns``, timed round-robin: ``warmup`` untimed rounds of every
    one, then ``repeats`` timed rounds.

    Why round-robin: a machine's speed drifts (a process that has just prefilled or decoded runs its
    first forwards slower for a second or two; another process wakes up). Timed one after the other,
    whichever part comes first takes the drift alone: a 1-token forward once read 75 ms against the
    2-token one's 51 ms, so every break-even AL came out below 1. In turns, every part sees the same
    machine, and the ratios the recommendation reads hold.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, timed in zip(fns, times):
            start = clock()
            fn()
            timed.append(clock() - start)
    return [statistics.median(timed) for timed in times]


@dataclass(frozen=True)
class StepCosts:
    """Seconds of each part of a step, at ``context`` tokens: ``verify_s[L-1]`` one target forward
    over L new tokens (L = 1 is a plain step's forward), ``draft_s[K-1]`` the draft's proposal of K
    tokens (over the target vocab, drafts picked), ``bookkeeping_s`` acceptance and the cache crop."""

    context: int
    verify_s: list[float]
    draft_s: list[float]
    bookkeeping_s: float
    pick_s: float
    batch_verify_s: dict[int, list[float]] = field(default_factory=dict)
    """Per batch size b > 1: ``[k]`` one target forward over b·(k + 1) new tokens, k = 0..max_depths
    (k = 0: b plain steps' forward)."""

    def batch_plain_s(self, b: int) -> float:
        """One plain step of ``b`` requests: a forward over b tokens and b picks."""
        return self.plain_s if b == 1 else self.batch_verify_s[b][0] + b * self.pick_s

    def fitted_batch_step_s(self, b: int) -> list[float]:
        """A step of ``b`` requests with K = k drafts, k = 1..max_depths, on its fitted line (as
        :meth:`fitted_step_s`, which it is at b = 1): the forward over b·(k + 1) tokens and b proposals."""
        if b == 1:
            return self.fitted_step_s()
        forward = self.batch_verify_s[b]
        return fitted_line([forward[k] + b * (self.draft_s[k - 1] + self.bookkeeping_s)
                            for k in range(1, self.max_depths + 1)])

    @property
    def max_depths(self) -> int:
        return len(self.draft_s)

    @property
    def plain_s(self) -> float:
        """One plain decoding step: a forward over one token and the pick of the next."""
        return self.verify_s[0] + self.pick_s

    def step_s(self, k: int) -> float:
        """One speculative step with K = k drafts."""
        return self.verify_s[k] + self.draft_s[k - 1] + self.bookkeeping_s

    def break_even(self, k: int) -> float:
        """The acceptance length at which K = k drafts neither speed nor slow decoding, as timed."""
        return self.step_s(k) / self.plain_s

    def fitted_step_s(self) -> list[float]:
        """``step_s(k)`` for k = 1..max_depths on the least-squares line through the timed ones (slope
        >= 0). Why: a step is one verification of K + 1 tokens, a proposal of K and a fixed part, each
        affine in K, but each K is timed apart, a few percent of noise apiece; the demo once read
        break-even ALs of 1.47 1.75 1.40 1.35 1.54 for K = 1..5, and an argmax over such values picks
        noise. The line keeps what K costs and drops what one timing got wrong."""
        return fitted_line([self.step_s(k) for k in range(1, self.max_depths + 1)])

    def fitted_break_even(self) -> list[float]:
        """:meth:`break_even` for k = 1..max_depths from :meth:`fitted_step_s`: what the K recommendation reads."""
        return [step / self.plain_s for step in self.fitted_step_s()]

    def to_dict(self) -> dict[str, Any]:
        batches = {str(b): {"plain_s": self.batch_plain_s(b), "fitted_step_s": self.fitted_batch_step_s(b)}
                   for b in sorted(self.batch_verify_s)}
        return {**asdict(self), "batch_verify_s": {str(b): v for b, v in sorted(self.batch_verify_s.items())},
                "batches": batches, "plain_s": self.plain_s,
                "step_s": [self.step_s(k) for k in range(1, self.max_depths + 1)],
                "break_even_acceptance_length": [self.break_even(k) for k in range(1, self.max_depths + 1)],
                "fitted_step_s": self.fitted_step_s(), "fitted_break_even_acceptance_length": self.fitted_break_even()}


def fitted_line(values: list[float]) -> list[float]:
    """``values[i]`` (at x = i + 1) on their least-squares line, its slope clamped at 0 from below: a
    step never gets cheaper with more drafts, so a falling fit is noise and the mean is the best level."""
    n = len(values)
    mean_x, mean_y = (n + 1) / 2, sum(values) / n
    spread = sum((x - mean_x) ** 2 for x in range(1, n + 1))
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values, start=1)) / spread) if n > 1 else 0.0
    return [mean_y + slope * (x - mean_x) for x in range(1, n + 1)]


def _crop_to(cache, length: int) -> None:
    """Keep the first ``length`` positions of a transformers cache (its negative form: the count to drop)."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


def _state_at(target: TargetLM, prompt_ids: list[int], context: int) -> DecodeState:
    """A decoding state of ``context`` tokens: the prompt repeated (its content does not change a
    forward's cost) and prefilled."""
    ids = (list(prompt_ids) * (context // max(1, len(prompt_ids)) + 1))[: context - 1]
    return prefill(target, ids, Sampler())


@torch.no_grad()
def measure_step_costs(target: TargetLM, drafter: Drafter, prompt_ids: list[int], *, max_depths: int,
                       context: int = DEFAULT_CONTEXT, repeats: int = 5,
                       batch_sizes: tuple[int, ...] = ()) -> StepCosts:
    """Time each part of a step in our own loop (module docstring) at ``context`` tokens of context,
    and the forwards of a step of each of ``batch_sizes`` (> 1) requests; the cache is cropped back
    after every timed verification, so every repeat sees the same state."""
    state = _state_at(target, prompt_ids, context)
    sampler = Sampler()
    kept = state.cache.get_seq_length()

    def forward(num_tokens: int) -> Callable[[], None]:
        def run() -> None:
            verify(target, state, [state.tokens[-1]] * (num_tokens - 1))
            _crop_to(state.cache, kept)
        return run

    logits_LV, aux_LAH = verify(target, state, [state.tokens[-1]] * max_depths)
    _crop_to(state.cache, kept)
    verifies = [forward(n) for n in range(1, max_depths + 2)]
    drafts = [lambda k=k: propose(drafter, state, k, sampler) for k in range(1, max_depths + 1)]
    medians = interleaved_medians([*verifies, *drafts, lambda: sampler.pick(logits_LV[0])], repeats=repeats)
    verify_s, draft_s, pick_s = medians[: len(verifies)], medians[len(verifies): -1], medians[-1]
    wide = sorted({b for b in batch_sizes if b > 1})
    counts = sorted({b * (k + 1) for b in wide for k in range(max_depths + 1)})
    timed_by_count = dict(zip(counts, interleaved_medians([forward(n) for n in counts], repeats=repeats)))
    batch_verify_s = {b: [timed_by_count[b * (k + 1)] for k in range(max_depths + 1)] for b in wide}

    def bookkeeping() -> None:
        trial = DecodeState(tokens=list(state.tokens), cache=state.cache, aux_PAH=state.aux_PAH)
        verify(target, trial, [state.tokens[-1]] * max_depths)  # the crop needs K + 1 new cache rows
        start = time.perf_counter()
        a, token = accept_greedy([state.tokens[-1]] * max_depths, logits_LV)
        commit(trial, [state.tokens[-1]] * max_depths, a, token, aux_LAH)
        timed.append(time.perf_counter() - start)
        _crop_to(state.cache, kept)

    timed: list[float] = []
    for _ in range(repeats + 1):
        bookkeeping()
    return StepCosts(context=context, verify_s=verify_s, draft_s=draft_s,
                     bookkeeping_s=statistics.median(timed[1:]), pick_s=pick_s, batch_verify_s=batch_verify_s)


def recommend_k(per_depth_acceptance: list[float], costs: StepCosts) -> dict[str, Any]:
    """Predicted tokens/s against plain decoding at every K the acceptance was measured for (and the
    costs were timed for), and the K with the most; ``per_depth_acceptance[d-1]`` = P(a >= d). The
    costs are the fitted ones (:meth:`StepCosts.fitted_step_s`); each row keeps the timed break-even too."""
    usable = [p for p in per_depth_acceptance[: costs.max_depths] if p is not None]
    if not usable or any(p != p for p in usable):  # NaN: nothing measured
        return {"best_k": None, "by_k": [], "reason": "no per-depth acceptance measured"}
    lengths = acceptance_lengths(usable, 1.0)
    fitted = costs.fitted_break_even()
    by_k = [{"k": k, "acceptance_length": al, "break_even_acceptance_length": fitted[k - 1],
             "timed_break_even_acceptance_length": costs.break_even(k), "predicted_speedup": al / fitted[k - 1]}
            for k, al in enumerate(lengths, start=1)]
    best = max(by_k, key=lambda row: row["predicted_speedup"])
    return {"best_k": best["k"], "predicted_speedup": best["predicted_speedup"], "by_k": by_k}


RECOMMENDATION_SOURCES = ("vllm", "online", "offline")
"""Whose per-depth acceptance the K recommendation reads, first found first: what vLLM served, else
our loop's, else the teacher-forced chains'."""


def k_recommendation(sections: dict[str, dict[str, Any]], costs: StepCosts, *, served_k: int,
                     parallel: bool = True) -> dict[str, Any]:
    """:func:`recommend_k` on the first mode of :data:`RECOMMENDATION_SOURCES` that measured a
    per-depth acceptance, with the predicted gain of the best K over the K this evaluation served, and
    the K per batch size (:func:`speculation_schedule`; ``parallel``: a P-EAGLE draft)."""
    for mode in RECOMMENDATION_SOURCES:
        per_depth = (sections.get(mode) or {}).get("per_depth_acceptance")
        if per_depth and all(p is not None and p == p for p in per_depth):
            break
    else:
        return {"best_k": None, "by_k": [], "reason": "no mode measured a per-depth acceptance"}
    found = recommend_k(per_depth, costs)
    served = next((row for row in found["by_k"] if row["k"] == served_k), None)
    gain = found["predicted_speedup"] / served["predicted_speedup"] if served and found.get("best_k") else None
    out = {"acceptance_from": mode, "costs_from": "own loop, this machine", "context": costs.context,
           "served_k": served_k, **found, "predicted_gain_over_served_k": gain}
    measured = ((sections.get(mode) or {}).get("speed") or {}).get("concurrency_1") or {}
    if served and measured.get("speedup"):
        # our loop's costs give the shape over K; what the served K measured where the acceptance came
        # from gives the level (vLLM's step is not our loop's: float32 transformers verify slowly here)
        scale = measured["speedup"] / served["predicted_speedup"]
        out["measured_speedup_at_served_k"] = measured["speedup"]
        out["calibrated_speedup"] = found["predicted_speedup"] * scale
        for row in out["by_k"]:
            row["calibrated_speedup"] = row["predicted_speedup"] * scale
    if found.get("best_k"):
        out["schedule"] = speculation_schedule(
            per_depth, costs, parallel=parallel, served_k=served_k,
            measured=measured_speedups((sections.get(mode) or {}).get("speed") or {}, served_k))
    return out


def measured_speedups(speed: dict[str, Any], served_k: int) -> dict[int, float]:
    """Concurrency -> the speedup a mode measured there while drafting K = ``served_k`` every step (a
    concurrency whose vLLM drafts per step differ, under a schedule, measured another K: left out)."""
    out = {}
    for key, figures in speed.items():
        figures = figures or {}
        concurrency = figures.get("concurrency") or (1 if key == "concurrency_1" else None)
        per_draft = figures.get("draft_tokens_per_draft")
        if concurrency and figures.get("speedup") and (per_draft is None or abs(per_draft - served_k) < 1e-6):
            out[int(concurrency)] = float(figures["speedup"])
    return out


def speculation_schedule(per_depth_acceptance: list[float], costs: StepCosts, *, parallel: bool, served_k: int,
                         measured: dict[int, float] | None = None) -> dict[str, Any]:
    """Per batch size timed (1 and :attr:`StepCosts.batch_verify_s`'s), the predicted speedup of every
    K the acceptance covers and the K with the most tokens per second, or 0 (no drafting) where none
    beats plain decoding: vLLM's ``num_speculative_tokens_per_batch_size`` and the K to export with it.

    A batch size where ``measured`` holds the speedup of ``served_k`` (vLLM at that concurrency) is
    read at that level (``calibrated_speedup``), as :func:`k_recommendation` reads concurrency 1. A
    P-EAGLE draft (``parallel``) is scheduled between the best K one request at a time and 0 only
    (peagle/schemas/speculative_schedule.py: what vLLM 0.32 serves right with parallel drafting).
    """
    usable = [p for p in per_depth_acceptance[: costs.max_depths] if p is not None]
    lengths = acceptance_lengths(usable, 1.0)
    measured = measured or {}
    by_batch = []
    for b in [1, *sorted(costs.batch_verify_s)]:
        steps, plain = costs.fitted_batch_step_s(b), costs.batch_plain_s(b)
        rows = [{"k": k, "predicted_speedup": al * plain / steps[k - 1]} for k, al in enumerate(lengths, start=1)]
        served = next((r for r in rows if r["k"] == served_k), None)
        if served and b in measured:
            for row in rows:
                row["calibrated_speedup"] = row["predicted_speedup"] * measured[b] / served["predicted_speedup"]
        by_batch.append({"batch_size": b, "measured_speedup_at_served_k": measured.get(b), "by_k": rows})

    def score(row: dict[str, Any]) -> float:
        return row.get("calibrated_speedup", row["predicted_speedup"])

    alone = max(by_batch[0]["by_k"], key=score)["k"]
    for entry in by_batch:
        candidates = [r for r in entry["by_k"] if r["k"] == alone] if parallel else entry["by_k"]
        best = max(candidates, key=score)
        entry["k"], entry["expected_speedup"] = (best["k"], score(best)) if score(best) > 1.0 else (0, 1.0)
    engine_k = max([alone, *(e["k"] for e in by_batch)])
    schedule: list[list[int]] = []
    for entry, following in zip(by_batch, [*by_batch[1:], None]):
        start, end = entry["batch_size"], following["batch_size"] - 1 if following else entry["batch_size"]
        if schedule and schedule[-1][2] == entry["k"]:
            schedule[-1][1] = end
        else:
            schedule.append([start, end, entry["k"]])
    return {"speculative_tokens": engine_k, "schedule": schedule, "text": schedule_text(schedule),
            "parallel_drafting": parallel, "by_batch_size": by_batch,
            "note": "the last range's K holds for every larger batch (vLLM's rule); own-loop step costs, "
                    "drafting costed as one proposal per request"}
