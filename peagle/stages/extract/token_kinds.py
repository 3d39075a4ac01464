"""Count a sample's tokens by what they are, so that a wrong loss mask shows at a glance.

Supervised tokens are counted by kind (``schemas.store.SUPERVISED_KINDS``): the reasoning text, the
tool calls, the end-of-turn token (the last supervised token of a turn when it is an added token
such as ``<|eot_id|>``), and the rest of the turn (content, and the template's own text inside it
such as ``<think>`` delimiters). A supervised token that starts inside another role's message is
counted as ``outside_assistant``: it should never happen, and if a template fools the span logic it
shows here. Unsupervised tokens are counted by the role of the message they start in (text a
template writes before the first message, such as BOS or a default system block, counts with the
first message: templates refuse to render an empty conversation), ``template`` for text after the
last message, and ``unattributed`` where the template renders history differently than the
messages alone (``spans.message_boundaries``).

A token is placed in a message by its first character, and is a reasoning or tool-call token when
most of its characters lie in that region (a region found by comparing two renders can be a
character off at either end where the renders happen to agree, e.g. ``<tool_call>`` vs
``<|im_end|>`` both start with ``<``).
"""

from __future__ import annotations

import bisect
from collections import Counter

from peagle.schemas import store as S
from peagle.stages.extract.spans import Span, TurnSpans


def count_token_kinds(offsets: list[tuple[int, int]], loss_mask: list[int], input_ids: list[int], *,
                      roles: list[str], boundaries: list[int | None], turns: list[TurnSpans],
                      end_token_ids: frozenset[int]) -> tuple[dict[str, int], int]:
    """(token counts keyed ``supervised.<kind>`` / ``unsupervised.<role>``, supervised turns).

    ``roles[j]`` is message j's role and ``boundaries`` its start/end as ``spans.message_boundaries``
    gives them; ``turns`` are the trained turns' regions. Only the tokens given are counted (pass the
    truncated lists for a truncated sample).
    """
    counts: Counter = Counter()
    region_of = _region_lookup(roles, boundaries)
    spans = sorted(turns, key=lambda t: t.span)
    last_of_turn = _last_supervised_token(offsets, loss_mask, [t.span for t in spans])
    k = 0
    for i, ((a, b), bit) in enumerate(zip(offsets, loss_mask)):
        role = region_of(a)
        if not bit:
            counts[f"{S.UNSUPERVISED}.{role}"] += 1
            continue
        b = max(b, a + 1)
        while k + 1 < len(spans) and spans[k].span[1] <= a:
            k += 1
        turn = spans[k] if spans else None
        if role not in ("assistant", "unattributed"):
            kind = S.OUTSIDE_ASSISTANT
        elif turn is not None and last_of_turn.get(k) == i and input_ids[i] in end_token_ids:
            kind = "end_of_turn"
        elif turn is not None and _mostly_inside(a, b, turn.reasoning):
            kind = "reasoning"
        elif turn is not None and _mostly_inside(a, b, turn.tool_calls):
            kind = "tool_call"
        else:
            kind = "content"
        counts[f"{S.SUPERVISED}.{kind}"] += 1
    num_turns = len(last_of_turn)
    return dict(counts), num_turns


def _mostly_inside(a: int, b: int, region: Span | None) -> bool:
    """At least half of the token's characters ``[a, b)`` lie in ``region``."""
    return region is not None and 2 * (min(b, region[1]) - max(a, region[0])) >= b - a


def _region_lookup(roles: list[str], boundaries: list[int | None]):
    """``position -> role`` from the message boundaries (module doc)."""
    known = [(b, j) for j, b in enumerate(boundaries) if b is not None]
    starts = [b for b, _ in known]

    def role_at(position: int) -> str:
        k = bisect.bisect_right(starts, position) - 1
        if k < 0:
            return "template"  # before the first known boundary: BOS, a default system block
        j = known[k][1]
        if j == len(roles):
            return "template"  # after the last message
        if k + 1 < len(known) and known[k + 1][1] == j + 1:
            return roles[j]
        return "unattributed"  # between boundaries more than one message apart

    return role_at


def _last_supervised_token(offsets: list[tuple[int, int]], loss_mask: list[int], spans: list[Span]) -> dict[int, int]:
    """turn position (in ``spans`` order) -> index of its last supervised token, for turns that kept one."""
    out: dict[int, int] = {}
    for i, ((a, b), bit) in enumerate(zip(offsets, loss_mask)):
        if not bit:
            continue
        b = max(b, a + 1)
        for k, (s, e) in enumerate(spans):
            if a < e and b > s:
                out[k] = i
    return out
