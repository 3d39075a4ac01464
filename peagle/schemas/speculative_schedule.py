"""A K that depends on the batch size: vLLM's ``num_speculative_tokens_per_batch_size``, as an export
carries it and as `peagle export --speculative-schedule` and `peagle eval` spell it.

vLLM 0.32 takes ``speculative_config={"num_speculative_tokens_per_batch_size": [[start, end, K], ...]}``
(vllm/config/speculative.py, the field; vllm/v1/spec_decode/dynamic/utils.py, its check and the dense
batch size -> K lookup; vllm/v1/core/sched/scheduler.py, the lookup by the number of requests each
step schedules): inclusive batch-size ranges, the first starting at 1, K = 0 meaning no drafting for
that step, the last range's K carried on to every larger batch and every K capped at the engine's
``num_speculative_tokens``. vLLM reads none of it from a speculators config.json (its
``build_vllm_speculative_config`` takes ``speculative_tokens`` only), so the export keeps it in its
``peagle`` section (:data:`SCHEDULE_KEY`) and whoever serves it passes it on
(`vllm serve EXPORT --speculative-config '{"num_speculative_tokens_per_batch_size": ...}'`;
`peagle eval` does it itself).

**P-EAGLE takes only K = the engine's K or 0.** With parallel drafting vLLM 0.32 sizes a step's mask
slots once, at engine start (``extra_slots_per_request = num_speculative_tokens``,
vllm/v1/spec_decode/llm_base_proposer.py:114), and samples every one of them, then reshapes the
drafts by the step's K (``draft_token_ids.view(-1, self.num_speculative_tokens)``, line 637): at a
smaller K, one request is handed the drafts of another. Measured on a fitted tiny draft (3 requests
at once, K = 2 out of an engine at K = 4): depth-1 acceptance 0.68 against 0.96 with the engine at
K = 2. K = 0 returns before that reshape (line 620) and is served right; sequential drafting
(EAGLE-3) takes any K, the same acceptance as an engine at that K.

Text form: ``1:5,2-3:4,4-8:0``, ranges ``START-END:K`` (or ``B:K``) in ascending order.
"""

from __future__ import annotations

from typing import Any

from peagle.schemas.errors import UserError

VLLM_KEY = "num_speculative_tokens_per_batch_size"
"""The field of vLLM's speculative_config that takes the schedule."""
SCHEDULE_KEY = "speculative_schedule"
"""Where the export's ``peagle`` section keeps it: ``[[start, end, K], ...]``."""

Schedule = list[list[int]]


def parse_schedule(text: str, flag: str = "--speculative-schedule") -> Schedule:
    """``"1:5,2-8:0"`` as ``[[1, 1, 5], [2, 8, 0]]`` (its order and ranges checked by :func:`check_schedule`).

    Raises:
        UserError: a part that is not ``START-END:K`` or ``B:K`` with integers.
    """
    schedule = []
    for part in str(text).split(","):
        sizes, colon, k = part.strip().partition(":")
        start, dash, end = sizes.partition("-")
        try:
            entry = [int(start), int(end if dash else start), int(k)]
        except ValueError:
            entry = None
        if not colon or entry is None:
            raise UserError(f"{flag} takes ranges of batch sizes and their K, e.g. 1:5,2-8:0 (K 5 for one "
                            f"request at a time, no drafting from 2 on), got {part.strip()!r}")
        schedule.append(entry)
    return schedule


def schedule_text(schedule: Schedule) -> str:
    """The text form of ``schedule`` (what :func:`parse_schedule` reads)."""
    return ",".join(f"{a}:{k}" if a == b else f"{a}-{b}:{k}" for a, b, k in schedule)


def check_schedule(schedule: Any, *, speculative_tokens: int, parallel: bool, where: str) -> Schedule:
    """``schedule`` as vLLM 0.32 serves it right, or one line naming ``where`` and the fault: a list of
    ``[start, end, K]``, ascending and not overlapping, the first from batch size 1, every K from 0 to
    ``speculative_tokens`` (a larger one vLLM would cap unsaid) and, for a P-EAGLE draft
    (``parallel``), every K either ``speculative_tokens`` or 0 (module docstring).

    Raises:
        UserError: the first fault found.
    """
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(schedule, list) or not schedule or not all(
            isinstance(e, (list, tuple)) and len(e) == 3 and all(is_int(v) for v in e) for e in schedule):
        raise UserError(f"{where}: the speculative schedule {schedule!r} is not a list of [start, end, K] integers")
    previous_end = 0
    for start, end, k in schedule:
        out_of_order = start != 1 if previous_end == 0 else start <= previous_end
        if out_of_order or start > end:
            raise UserError(f"{where}: the speculative schedule's batch sizes must run in ascending ranges from 1 "
                            f"({schedule_text(schedule)})")
        if not 0 <= k <= speculative_tokens:
            raise UserError(f"{where}: the speculative schedule asks K = {k} for batch sizes {start}-{end}; the "
                            f"export serves K = {speculative_tokens}, so K goes from 0 (no drafting) to it")
        if parallel and k not in (0, speculative_tokens):
            raise UserError(f"{where}: a P-EAGLE draft's schedule takes K = {speculative_tokens} (the served K) or 0, "
                            f"not K = {k} for batch sizes {start}-{end}: vLLM 0.32 drafts every parallel step "
                            "with the engine's K mask slots and hands one request another's drafts at a smaller K")
        previous_end = end
    return [list(entry) for entry in schedule]
