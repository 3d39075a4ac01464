"""Where each part of an assistant turn sits in a rendered conversation, found by rendering.

Chat templates have no generation markers, so everything here compares renders of the same
conversation (all positions are characters of the rendered text):

* **the turn's span** (what the draft learns): assistant message ``t`` starts where
  ``render(messages[:t], add_generation_prompt)`` stops agreeing with ``render(messages[:t+1])``
  (right after the generation prompt; for a prompt that adds e.g. ``<think>\\n``, at the first
  character the model itself writes) and ends at the end of ``render(messages[:t+1])`` minus
  trailing whitespace, so the end-of-turn token is in it and the newline a template prints after it
  is not (the target stops at the end-of-turn token). Both renders must be text prefixes of the
  sample, else the template rewrites history and the span cannot be located in this text.
* **the reasoning block** and **the tool calls** inside a span: the region where the render of the
  turn differs from the render of the same turn without its ``reasoning_content`` (or
  ``<think>...</think>`` prefix), or without its ``tool_calls``; the reasoning region is narrowed to
  the reasoning text itself when the text occurs there verbatim.
* **message boundaries**: ``len(render(messages[:j]))`` for each j whose render is a prefix of the
  sample (None where a template renders history differently once more messages follow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peagle.stages.extract.conversation import (EMPTY_AFTER_TEMPLATE, TEMPLATE_ERROR, TEMPLATE_PREFIX_MISMATCH,
                                                Conversation, SkipRecord)

Span = tuple[int, int]


class Renderer:
    """Renders prefixes of one conversation as text, each at most once.

    ``render(n)`` is ``messages[:n]``; ``render(n, prompt=True)`` adds the generation prompt;
    ``render_variant(n, message)`` is ``messages[:n-1] + [message]`` (not cached).
    """

    def __init__(self, tokenizer: Any, conversation: Conversation) -> None:
        self._tokenizer = tokenizer
        self.conversation = conversation
        self._cache: dict[tuple[int, bool], str] = {}

    def __call__(self, num_messages: int, prompt: bool = False) -> str:
        key = (num_messages, prompt)
        if key not in self._cache:
            self._cache[key] = self._render(self.conversation.messages[:num_messages], prompt)
        return self._cache[key]

    def render_variant(self, num_messages: int, last: dict[str, Any]) -> str:
        return self._render([*self.conversation.messages[:num_messages - 1], last], False)

    def _render(self, messages: list[dict[str, Any]], prompt: bool) -> str:
        # Fresh dict copies: a template must not be able to change the messages of a later render.
        messages = [dict(m) for m in messages]
        kwargs = {"tools": self.conversation.tools} if self.conversation.tools else {}
        try:
            text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                                       **kwargs)
        except Exception as err:  # templates are user code: any failure is a property of this record
            raise SkipRecord(TEMPLATE_ERROR, f"chat template failed: {type(err).__name__}: {err}") from None
        if not isinstance(text, str):
            raise SkipRecord(TEMPLATE_ERROR, f"chat template returned {type(text).__name__}, not text")
        return text


@dataclass(frozen=True, kw_only=True)
class TurnSpans:
    """Character regions of one assistant turn in a sample's text (``None``: the turn has none)."""

    turn: int  # index of the assistant message
    span: Span  # what the model writes for this turn, end-of-turn token included
    reasoning: Span | None  # the reasoning text inside ``span``
    tool_calls: Span | None  # the rendered tool calls inside ``span``


def locate_turn(render: Renderer, text: str, turn: int) -> TurnSpans:
    """The regions of assistant message ``turn`` in ``text`` (module doc).

    Raises:
        SkipRecord: ``template_prefix_mismatch`` when the renders up to this turn are not prefixes
            of ``text``; ``empty_after_template`` when the turn renders to no text.
    """
    upto_turn = render(turn + 1)
    history = render(turn)
    if not (text.startswith(upto_turn) and upto_turn.startswith(history)):
        raise SkipRecord(TEMPLATE_PREFIX_MISMATCH, f"rendering message {turn} changes the text of earlier messages")
    prompt = render(turn, prompt=True)
    start = max(len(history), common_prefix_len(prompt, upto_turn))
    end = len(upto_turn.rstrip())
    if end <= start:
        raise SkipRecord(EMPTY_AFTER_TEMPLATE, f"assistant message {turn} renders to no text")
    span = (start, end)
    message = render.conversation.messages[turn]
    return TurnSpans(turn=turn, span=span, reasoning=_reasoning_region(render, upto_turn, turn, message, span),
                     tool_calls=_tool_call_region(render, upto_turn, turn, message, span))


def reasoning_text(message: dict[str, Any]) -> str | None:
    """The turn's reasoning: ``reasoning_content``, else the ``<think>...</think>`` prefix of the
    content (the convention of reasoning models' data); None when there is none."""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        return reasoning.strip()
    content = message.get("content")
    if isinstance(content, str) and "</think>" in content:
        inline = content.split("</think>")[0].split("<think>")[-1].strip()
        return inline or None
    return None


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    content = out.get("content")
    if isinstance(content, str) and "</think>" in content and "reasoning_content" not in message:
        out["content"] = content.split("</think>")[-1].lstrip("\n")
    return out


def _reasoning_region(render: Renderer, upto_turn: str, turn: int, message: dict[str, Any], span: Span) -> Span | None:
    reasoning = reasoning_text(message)
    if reasoning is None:
        return None
    region = _variant_region(render, upto_turn, turn, _without_reasoning(message), span)
    if region is None:
        return None
    found = upto_turn.find(reasoning, region[0], region[1])
    return (found, found + len(reasoning)) if found >= 0 else region


def _tool_call_region(render: Renderer, upto_turn: str, turn: int, message: dict[str, Any], span: Span) -> Span | None:
    if not message.get("tool_calls"):
        return None
    return _variant_region(render, upto_turn, turn, {k: v for k, v in message.items() if k != "tool_calls"}, span)


def _variant_region(render: Renderer, upto_turn: str, turn: int, variant: dict[str, Any], span: Span) -> Span | None:
    """Where ``upto_turn`` differs from the render with message ``turn`` replaced by ``variant``,
    within ``span``; None when the template renders both alike or refuses the variant."""
    try:
        other = render.render_variant(turn + 1, variant)
    except SkipRecord:
        return None
    if other == upto_turn:
        return None
    start, end = diff_region(upto_turn, other)
    start, end = max(start, span[0]), min(end, span[1])
    return (start, end) if end > start else None


def message_boundaries(render: Renderer, text: str, num_messages: int) -> list[int | None]:
    """``len(render(j))`` for j = 0..num_messages where that render is a prefix of ``text``, else None."""
    out: list[int | None] = []
    for j in range(num_messages + 1):
        try:
            rendered = render(j)
        except SkipRecord:  # e.g. a template that cannot render an empty conversation
            out.append(0 if j == 0 else None)
            continue
        out.append(len(rendered) if text.startswith(rendered) else None)
    return out


def diff_region(a: str, b: str) -> Span:
    """``[start, end)`` of ``a`` outside the longest common prefix and suffix of ``a`` and ``b``."""
    start = common_prefix_len(a, b)
    room = min(len(a), len(b)) - start
    suffix = common_prefix_len(a[::-1], b[::-1])
    return start, len(a) - min(suffix, room)


def common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first difference: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def spans_to_token_mask(offsets: list[tuple[int, int]], spans: list[Span]) -> list[int]:
    """1 for each token whose character range ``[a, b)`` overlaps some span ``[s, e)``, else 0.

    Both lists are in text order, so one merge pass suffices. A zero-width token counts as covering
    its start character.
    """
    mask = [0] * len(offsets)
    spans = sorted(spans)
    k = 0
    for i, (a, b) in enumerate(offsets):
        b = max(b, a + 1)
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        if k < len(spans) and spans[k][0] < b:
            mask[i] = 1
    return mask
