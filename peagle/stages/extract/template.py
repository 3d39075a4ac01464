"""Apply the target's chat template and mark the tokens the draft must learn (docs/indexing.md loss_mask).

Real chat templates have no generation markers, so each assistant turn is located by rendering
prefixes (and variants) of the conversation as text (``spans``): the supervised part of a turn is
what the model writes for it -- its content, the reasoning block where the template renders one,
the tool calls it emits -- and its end-of-turn token; never system, user or tool-result text, role
headers or generation-prompt scaffolding. The sample text is rendered once and tokenized once with
offsets; a token is supervised when its characters overlap a supervised span. Working in characters
instead of comparing token prefixes makes the result independent of how BPE merges across a prefix
boundary; a token that straddles the start of a span carries assistant text and so is supervised.

Templates that rewrite history (Qwen3 drops the reasoning of turns before the last user query and
gives only the last turn an empty think block) make the earlier turns' prefix renders disagree with
the whole conversation's text, so their spans cannot be located in it. With ``loss_on="all"`` such a
record becomes one sample per assistant turn, each the conversation rendered up to and including
that turn -- exactly the text the target sees when it writes that turn -- and is counted
(``PreparedRecord.rendered_per_turn``). A turn that cannot be located even so is a counted skip
(``template_prefix_mismatch``), never a silently wrong mask.

Conversations are cut after the last trained assistant turn: later tokens would carry no loss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from peagle.schemas.errors import UserError
from peagle.stages.extract.conversation import (
    CONTAINS_MASK_TOKEN,
    EMPTY_AFTER_TEMPLATE,
    INVALID_UTF8,
    TEMPLATE_PREFIX_MISMATCH,
    TRUNCATED_NO_LOSS,
    Conversation,
    SkipRecord,
    normalise_record,
)
from peagle.stages.extract.readers import SourceRecord
from peagle.stages.extract.spans import Renderer, TurnSpans, locate_turn, message_boundaries, spans_to_token_mask
from peagle.stages.extract.token_kinds import count_token_kinds

LOSS_ON_MODES = ("all", "last", "per_turn")
SAMPLE_ID_HEX_CHARS = 20


@dataclass(frozen=True, kw_only=True)
class TokenizedSample:
    """One training sample: ``loss_mask[i] = 1`` iff ``input_ids[i]`` is an assistant token to learn.

    ``token_counts`` counts its tokens by kind and role (``token_kinds``); ``num_turns`` is the
    number of assistant turns with at least one supervised token.
    """

    sample_id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]
    token_counts: dict[str, int] = field(default_factory=dict)
    num_turns: int = 0


@dataclass(frozen=True, kw_only=True)
class PreparedRecord:
    """What one record became.

    ``skip_reason`` is set (one of ``conversation.SKIP_REASONS``) iff ``samples`` is empty;
    ``skip_detail`` says what exactly, for ``--strict`` errors. ``num_truncated`` counts kept samples
    that were cut to ``max_seq_len``; ``num_dropped`` counts per-turn samples dropped because
    truncation left them no loss while earlier turns of the same record were kept;
    ``rendered_per_turn`` says the record was split into one sample per turn because its template
    rewrites history (module doc).
    """

    samples: list[TokenizedSample] = field(default_factory=list)
    skip_reason: str | None = None
    skip_detail: str | None = None
    num_truncated: int = 0
    num_dropped: int = 0
    rendered_per_turn: bool = False


def prepare_record(
    record: SourceRecord,
    tokenizer: Any,
    *,
    loss_on: str = "all",
    max_seq_len: int,
    mask_token_id: int | None = None,
    supervise_reasoning: bool = True,
) -> PreparedRecord:
    """Turn one source record into tokenized samples with loss masks, or a counted skip.

    ``loss_on``: ``all`` (every assistant turn: one sample, or one per turn when the template
    rewrites history), ``last`` (the last assistant turn only, one sample) or ``per_turn`` (one
    sample per assistant turn: the conversation up to and including that turn, loss on that turn).
    ``mask_token_id`` (the draft's mask token) must not occur in any rendered sample; if it does,
    the whole record is skipped (``contains_mask_token``). ``supervise_reasoning=False`` takes the
    reasoning text out of the loss (the template's delimiters around it stay in).

    ``sample_id`` hashes (file basename, record index, turn, canonical record JSON); ``turn`` is the
    index of the trained assistant message for a per-turn sample, else -1.

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
        return _prepare(record, canonical, conversation, tokenizer, loss_on=loss_on, max_seq_len=max_seq_len,
                        mask_token_id=mask_token_id, supervise_reasoning=supervise_reasoning)
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


def _prepare(record: SourceRecord, canonical: str, conversation: Conversation, tokenizer: Any, *,
             loss_on: str, max_seq_len: int, mask_token_id: int | None, supervise_reasoning: bool) -> PreparedRecord:
    render = Renderer(tokenizer, conversation)
    turns = conversation.trainable_turns
    per_turn = [_Plan(turn, render(turn + 1), [turn]) for turn in turns] if loss_on == "per_turn" else None
    rendered_per_turn = False
    if per_turn is None:
        selected = turns if loss_on == "all" else turns[-1:]
        plan = _Plan(-1, render(turns[-1] + 1), selected)
        try:
            plans = [plan.located(render)]
        except SkipRecord as skip:
            if skip.reason != TEMPLATE_PREFIX_MISMATCH or len(selected) == 1:
                raise
            per_turn, rendered_per_turn = [_Plan(turn, render(turn + 1), [turn]) for turn in selected], True
    if per_turn is not None:
        plans = [plan.located(render) for plan in per_turn]

    end_ids = frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
    samples: list[TokenizedSample] = []
    num_truncated = num_dropped = 0
    for plan in plans:
        encoding = tokenizer(plan.text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        input_ids, offsets = list(encoding["input_ids"]), [tuple(o) for o in encoding["offset_mapping"]]
        if mask_token_id is not None and mask_token_id in input_ids:
            raise SkipRecord(CONTAINS_MASK_TOKEN, f"the rendered record contains the mask token id {mask_token_id}")
        loss_mask = spans_to_token_mask(offsets, [t.span for t in plan.spans])
        if not supervise_reasoning:  # every token that carries reasoning text leaves the loss
            reasoning = spans_to_token_mask(offsets, [t.reasoning for t in plan.spans if t.reasoning is not None])
            loss_mask = [int(a and not b) for a, b in zip(loss_mask, reasoning)]
        if not any(loss_mask):
            raise SkipRecord(EMPTY_AFTER_TEMPLATE, f"no token overlaps the assistant turn(s) {plan.trained}")
        if len(input_ids) > max_seq_len:
            input_ids, loss_mask, offsets = input_ids[:max_seq_len], loss_mask[:max_seq_len], offsets[:max_seq_len]
            if not any(loss_mask):
                num_dropped += 1
                continue
            num_truncated += 1
        num_messages = plan.trained[-1] + 1
        counts, num_turns = count_token_kinds(
            offsets, loss_mask, input_ids, roles=[m["role"] for m in conversation.messages[:num_messages]],
            boundaries=message_boundaries(render, plan.text, num_messages), turns=plan.spans, end_token_ids=end_ids)
        sample_id = make_sample_id(record.basename, record.index, plan.turn, canonical)
        samples.append(TokenizedSample(sample_id=sample_id, source=f"{record.basename}:{record.index}",
                                       input_ids=input_ids, loss_mask=loss_mask, token_counts=counts,
                                       num_turns=num_turns))
    if not samples:
        raise SkipRecord(TRUNCATED_NO_LOSS, f"no assistant token within max_seq_len {max_seq_len}")
    return PreparedRecord(samples=samples, num_truncated=num_truncated, num_dropped=num_dropped,
                          rendered_per_turn=rendered_per_turn)


@dataclass
class _Plan:
    """One sample to build: ``text`` (the conversation rendered up to its last trained turn), the
    trained turns, and (once located) their regions. ``turn`` is -1 unless it is a per-turn sample."""

    turn: int
    text: str
    trained: list[int]
    spans: list[TurnSpans] = field(default_factory=list)

    def located(self, render: Renderer) -> "_Plan":
        return _Plan(self.turn, self.text, self.trained, [locate_turn(render, self.text, t) for t in self.trained])
