"""``--regenerate``: replace each assistant turn with the target's own response before extraction.

The draft should learn the distribution the target will actually produce at inference, not the
dataset's authors'. Turns are regenerated in rounds: round j generates the j-th trainable assistant
turn of every record of the shard, with the conversation so far (earlier turns already regenerated)
as the prompt. Prompts are batched in record order and each batch samples with a seed derived from
(run seed, shard index, round, batch), so a re-run or any worker split regenerates the same text.

Records may be prompts only (empty assistant turns, or none after the last user turn:
``normalise_record(..., to_regenerate=True)``). A record that cannot be read as a conversation is
passed through unchanged: ``prepare_record`` then
skips it with the same reason it would have without ``--regenerate``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable

from peagle.model.target.backend import Generator
from peagle.stages.extract.conversation import SkipRecord, normalise_record
from peagle.stages.extract.readers import SourceRecord


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int


def derived_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (so batches, rounds and shards never share a draw)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class _Conversation:
    record: SourceRecord
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    turns: list[int]  # trainable assistant message indices, ascending


def regenerate_records(records: list[SourceRecord], backend: Generator, tokenizer: Any, *,
                       sampling: SamplingSettings, shard_index: int, batch_size: int,
                       max_seq_len: int, echo: Callable[[str], None] | None = None) -> list[SourceRecord]:
    """The shard's records with every trainable assistant turn replaced by the target's response.

    A turn whose prompt already fills ``max_seq_len`` is dropped with everything after it (those
    tokens would be truncated away anyway). ``echo`` gets one line per round when it ends (answers,
    tokens, tokens/s): generation is most of an extraction's time, and silent otherwise.
    """
    conversations: dict[int, _Conversation] = {}
    for position, record in enumerate(records):
        if record.error is not None:
            continue
        try:
            conv = normalise_record(record.raw, to_regenerate=True)
        except SkipRecord:
            continue
        conversations[position] = _Conversation(record, [dict(m) for m in conv.messages], conv.tools,
                                                list(conv.trainable_turns))
    num_rounds = max((len(c.turns) for c in conversations.values()), default=0)
    for round_index in range(num_rounds):
        todo: list[tuple[_Conversation, int, list[int]]] = []
        for conv in conversations.values():
            if round_index >= len(conv.turns):
                continue
            turn = conv.turns[round_index]
            prompt = _prompt_ids(tokenizer, conv, turn)
            if prompt is None or len(prompt) >= max_seq_len:
                conv.messages = conv.messages[:turn]  # nothing after this turn can fit or render
                conv.turns = conv.turns[:round_index]
                continue
            todo.append((conv, turn, prompt))
        started, num_tokens = time.monotonic(), 0
        for batch_index, batch in enumerate(_generation_batches(todo, backend.name, batch_size,
                                                                sampling.max_new_tokens, max_seq_len)):
            # a prompt plus its answer must fit in max_seq_len (vLLM's engine is sized for it)
            room = min(max_seq_len - len(prompt) for _, _, prompt in batch)
            completions = backend.generate(
                [prompt for _, _, prompt in batch], max_new_tokens=min(sampling.max_new_tokens, room),
                temperature=sampling.temperature, top_p=sampling.top_p,
                seed=derived_seed(sampling.seed, shard_index, round_index, batch_index))
            for (conv, turn, _), token_ids in zip(batch, completions):
                text = tokenizer.decode(token_ids, skip_special_tokens=True)
                conv.messages[turn] = {"role": "assistant", "content": text}
                num_tokens += len(token_ids)
        for note in _take_notes(backend):
            if echo is not None:
                echo(f"warning: {note}")
        if echo is not None and todo:
            seconds = time.monotonic() - started
            echo(f"regenerated shard {shard_index}, round {round_index + 1} of {num_rounds}: {len(todo)} answers, "
                 f"{num_tokens:,} tokens in {seconds:.0f} s ({num_tokens / max(seconds, 1e-9):.0f} tokens/s)")
    out = list(records)
    for position, conv in conversations.items():
        raw = {"messages": conv.messages, **({"tools": conv.tools} if conv.tools else {})}
        out[position] = SourceRecord(conv.record.path, conv.record.index, raw)
    return out


def _take_notes(backend: Generator) -> list[str]:
    """What the backend had to give up while generating (HFBackend.generation_notes), once each."""
    notes = getattr(backend, "generation_notes", None)
    if not notes:
        return []
    taken = list(notes)
    notes.clear()
    return taken


def _generation_batches(todo: list, backend_name: str, batch_size: int, max_new_tokens: int,
                        max_seq_len: int) -> list[list]:
    """Fixed batches in record order. vLLM schedules continuously, so it gets one call per answer
    budget (almost always a single call: every prompt with room for ``max_new_tokens``)."""
    if backend_name != "vllm":
        return [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    groups: dict[int, list] = {}
    for item in todo:
        groups.setdefault(min(max_new_tokens, max_seq_len - len(item[2])), []).append(item)
    return list(groups.values())


def _prompt_ids(tokenizer: Any, conv: _Conversation, turn: int) -> list[int] | None:
    kwargs = {"tools": conv.tools} if conv.tools else {}
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in conv.messages[:turn]], tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception:  # templates are user code; prepare_record reports this record's failure
        return None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
