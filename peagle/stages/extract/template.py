"""Apply the target's chat template and mark the tokens the draft must learn (DESIGN §3 loss_mask).

Real chat templates have no generation markers, so assistant spans are found by rendering prefixes
of the conversation as text:

* the span of assistant message ``i`` starts where ``render(messages[:i], add_generation_prompt)``
  stops agreeing with ``render(messages[:i+1])`` (normally: right after the generation prompt; for
  templates whose generation prompt adds e.g. ``<think>\\n``, at the first character where the
  rendered turn differs from it, i.e. the first character the model itself produces);
* it ends at the end of ``render(messages[:i+1])`` minus trailing whitespace. So the end-of-turn
  token (``<|eot_id|>``, ``<|im_end|>``) IS in the loss mask: the draft must learn to propose it. The
  newline some templates print after it is not: the target stops at the end-of-turn token and never
  generates that newline.

The sample text is rendered once and tokenized once with offsets; a token is an assistant token when
its characters overlap an assistant span. Working in characters instead of comparing token prefixes
makes the result independent of how BPE happens to merge across a prefix boundary; a token that
straddles the start of a span carries assistant text and so is supervised.

Every assistant turn's prefix render must be a text prefix of the sample (checked); templates that
rewrite history (e.g. drop the reasoning of earlier turns) fail that check in ``all`` mode and the
record is skipped as ``template_prefix_mismatch``: ``per_turn`` always works for them, since there
the trained turn is the last one rendered.

Conversations are cut after the last assistant turn: later tokens would carry no loss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from peagle.schemas.errors import UserError
from peagle.stages.extract.conversation import (
    EMPTY_AFTER_TEMPLATE,
    FORBIDDEN_TOKEN,
    INVALID_UTF8,
    TEMPLATE_ERROR,
    TEMPLATE_PREFIX_MISMATCH,
    TRUNCATED_NO_LOSS,
    Conversation,
    SkipRecord,
    normalise_record,
)
from peagle.stages.extract.readers import SourceRecord

LOSS_ON_MODES = ("all", "last", "per_turn")
SAMPLE_ID_HEX_CHARS = 20


@dataclass(frozen=True, kw_only=True)
class TokenizedSample:
    """One training sample: ``loss_mask[i] = 1`` iff ``input_ids[i]`` is an assistant token to learn."""

    sample_id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True, kw_only=True)
class PreparedRecord:
    """What one record became.

    ``skip_reason`` is set (one of ``conversation.SKIP_REASONS``) iff ``samples`` is empty;
    ``skip_detail`` says what exactly, for ``--strict`` errors. ``num_truncated`` counts kept samples
    that were cut to ``max_seq_len``; ``num_dropped`` counts ``per_turn`` samples dropped because
    truncation left them no loss while earlier turns of the same record were kept.
    """

    samples: list[TokenizedSample] = field(default_factory=list)
    skip_reason: str | None = None
    skip_detail: str | None = None
    num_truncated: int = 0
    num_dropped: int = 0


def prepare_record(
    record: SourceRecord,
    tokenizer: Any,
    *,
    loss_on: str = "all",
    max_seq_len: int,
    forbidden_token_ids: frozenset[int] = frozenset(),
) -> PreparedRecord:
    """Turn one source record into tokenized samples with loss masks, or a counted skip.

    ``loss_on``: ``all`` (every assistant turn, one sample), ``last`` (the last assistant turn only,
    one sample) or ``per_turn`` (one sample per assistant turn: the conversation up to and including
    that turn, loss on that turn). ``forbidden_token_ids`` (e.g. the draft's mask token) must not
    occur in any rendered sample; if one does, the whole record is skipped (``forbidden_token``).

    ``sample_id`` hashes (file basename, record index, turn, canonical record JSON); ``turn`` is the
    index of the trained assistant message in the normalised conversation for ``per_turn``, else -1.

    Raises:
        UserError: bad ``loss_on`` or ``max_seq_len``, or a tokenizer without offsets (not "fast") or
            without a chat template: problems of the whole job, not of one record.
    """
    if loss_on not in LOSS_ON_MODES:
        raise UserError(f"loss_on {loss_on!r} is not one of {', '.join(LOSS_ON_MODES)}")
    if max_seq_len < 2:
        raise UserError(f"max_seq_len {max_seq_len} is too small (needs at least 2 tokens)")
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("the target tokenizer is not a fast tokenizer (offset mappings are needed)")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the target tokenizer has no chat template (tokenizer_config.json: chat_template)")
    if record.error is not None:
        return PreparedRecord(skip_reason=record.error, skip_detail=record.error)
    try:
        canonical = canonical_json(record.raw)
        conversation = normalise_record(record.raw)
        return _prepare(record, canonical, conversation, tokenizer, loss_on, max_seq_len, forbidden_token_ids)
    except SkipRecord as skip:
        return PreparedRecord(skip_reason=skip.reason, skip_detail=skip.detail or skip.reason)


def canonical_json(raw: dict[str, Any]) -> str:
    """The record as canonical JSON (sorted keys, no spaces): the content part of its sample_id.

    Raises:
        SkipRecord: the record holds strings that are not valid Unicode (lone surrogates from
            ``\\ud800`` escapes), which no tokenizer can encode.
    """
    text = json.dumps(raw, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SkipRecord(INVALID_UTF8, "record holds a lone surrogate (\\ud800-\\udfff escape)") from None
    return text


def make_sample_id(basename: str, index: int, turn: int, canonical: str) -> str:
    """Stable sample id: sha256 over (file basename, record index, turn or -1, canonical record).

    Basename (not the full path) so the same data mounted elsewhere gives the same ids.
    """
    digest = hashlib.sha256(f"{basename}\n{index}\n{turn}\n{canonical}".encode("utf-8")).hexdigest()
    return digest[:SAMPLE_ID_HEX_CHARS]


def _prepare(
    record: SourceRecord,
    canonical: str,
    conversation: Conversation,
    tokenizer: Any,
    loss_on: str,
    max_seq_len: int,
    forbidden_token_ids: frozenset[int],
) -> PreparedRecord:
    render = _Renderer(tokenizer, conversation)
    turns = conversation.trainable_turns
    source = f"{record.basename}:{record.index}"
    if loss_on == "per_turn":
        plans = [(turn, render(turn + 1), [turn]) for turn in turns]
    else:
        selected = turns if loss_on == "all" else turns[-1:]
        plans = [(-1, render(turns[-1] + 1), selected)]

    samples: list[TokenizedSample] = []
    num_truncated = num_dropped = 0
    for turn, text, trained_turns in plans:
        spans = [_assistant_span(render, text, t) for t in trained_turns]
        input_ids, loss_mask = _tokenize_with_mask(tokenizer, text, spans)
        if forbidden_token_ids and not forbidden_token_ids.isdisjoint(input_ids):
            raise SkipRecord(FORBIDDEN_TOKEN, "the rendered record contains a reserved token (e.g. the mask token)")
        if not any(loss_mask):
            raise SkipRecord(EMPTY_AFTER_TEMPLATE, f"no token overlaps the assistant turn(s) {trained_turns}")
        if len(input_ids) > max_seq_len:
            input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
            if not any(loss_mask):
                num_dropped += 1
                continue
            num_truncated += 1
        sample_id = make_sample_id(record.basename, record.index, turn, canonical)
        samples.append(TokenizedSample(sample_id=sample_id, source=source, input_ids=input_ids, loss_mask=loss_mask))
    if not samples:
        raise SkipRecord(TRUNCATED_NO_LOSS, f"no assistant token within max_seq_len {max_seq_len}")
    return PreparedRecord(samples=samples, num_truncated=num_truncated, num_dropped=num_dropped)


class _Renderer:
    """Renders prefixes of one conversation as text, each at most once.

    ``render(n)`` is ``messages[:n]``; ``render(n, prompt=True)`` adds the generation prompt.
    """

    def __init__(self, tokenizer: Any, conversation: Conversation) -> None:
        self._tokenizer = tokenizer
        self._conversation = conversation
        self._cache: dict[tuple[int, bool], str] = {}

    def __call__(self, num_messages: int, prompt: bool = False) -> str:
        key = (num_messages, prompt)
        if key not in self._cache:
            self._cache[key] = self._render(num_messages, prompt)
        return self._cache[key]

    def _render(self, num_messages: int, prompt: bool) -> str:
        # Fresh dict copies: a template must not be able to change the messages of a later render.
        messages = [dict(m) for m in self._conversation.messages[:num_messages]]
        kwargs = {"tools": self._conversation.tools} if self._conversation.tools else {}
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt, **kwargs
            )
        except Exception as err:  # templates are user code: any failure is a property of this record
            raise SkipRecord(TEMPLATE_ERROR, f"chat template failed: {type(err).__name__}: {err}") from None
        if not isinstance(text, str):
            raise SkipRecord(TEMPLATE_ERROR, f"chat template returned {type(text).__name__}, not text")
        return text


def _assistant_span(render: _Renderer, text: str, turn: int) -> tuple[int, int]:
    """Character span ``[start, end)`` in ``text`` of assistant message ``turn`` (see module doc)."""
    upto_turn = render(turn + 1)
    history = render(turn)
    if not (text.startswith(upto_turn) and upto_turn.startswith(history)):
        raise SkipRecord(
            TEMPLATE_PREFIX_MISMATCH, f"rendering message {turn} changes the text of earlier messages"
        )
    prompt = render(turn, prompt=True)
    start = max(len(history), _common_prefix_len(prompt, upto_turn))
    end = len(upto_turn.rstrip())
    if end <= start:
        raise SkipRecord(EMPTY_AFTER_TEMPLATE, f"assistant message {turn} renders to no text")
    return start, end


def _common_prefix_len(a: str, b: str) -> int:
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


def _tokenize_with_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` (as ``apply_chat_template(tokenize=True)`` gives them) and a 0/1 mask of
    the tokens whose characters overlap any span."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    input_ids = list(encoding["input_ids"])
    return input_ids, spans_to_token_mask(encoding["offset_mapping"], spans)


def spans_to_token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
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
