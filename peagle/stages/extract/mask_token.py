"""Choose the draft's mask token once, for the whole store (docs/store.md, docs/draft-and-export.md).

P-EAGLE's depth >= 1 inputs are ``embed(mask_token_id)``: an id of the target's embedding that
never occurs in the data, or the draft could not tell a mask slot from a real token. No released
tokenizer has a token for it (Llama-3, Qwen2/3, Mistral, gpt-oss, DeepSeek do not), so extract
chooses one, in this order:

1. the tokenizer's own mask token (its ``mask_token``, or a special token named like one:
   ``<mask>``, ``<|mask|>``, ``[MASK]``);
2. an embedding row past every id the tokenizer can produce, when the config's ``vocab_size`` is
   larger than the tokenizer (Qwen-style padded vocabularies): the first such row;
3. a reserved special token (``<|reserved_special_token_N|>``, ``<unusedN>``, ``[control_N]``):
   the one with the highest id, which fine-tunes are least likely to have put to use;
4. another added special token that the chat template never writes: the one with the highest id
   (SmolLM2: ``<empty_output>``, id 16, one of the 14 code-corpus markers such as ``<filename>`` and
   ``<jupyter_code>`` that a chat never contains). Only tokens marked *special* qualify: ordinary
   text never tokenizes into them (only their literal markup would), and decoding drops them, so a
   regenerated answer cannot carry one either. Qwen3's ``<think>`` and ``<tool_call>`` are added but
   not special (the model writes them), so they never qualify, nor does any token whose text
   appears in the template's source (it may write it for tools, reasoning or roles our probe
   conversations do not exercise);
5. otherwise a one-line error that names ``--mask-token-id``, what was tried and candidate ids a
   user could pass (docs/mask.md says how to choose).

The choice is a pure function of the tokenizer and the target config, so every extraction worker
of a store computes the same id, and it is part of the store's settings (checked like the others).
Candidates the chat template writes into conversations (probed with plain, tool-calling and
reasoning conversations) are never chosen, and an explicit
``--mask-token-id`` that the template writes is refused (every record would be skipped). Whether an
id occurs in the data is checked where samples are written: a record whose rendered tokens contain
the mask token is skipped and counted as ``contains_mask_token`` (``template.prepare_record``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from peagle.schemas import store as S
from peagle.schemas.errors import UserError

MASK_NAMES = frozenset({"<mask>", "<|mask|>", "[MASK]", "<MASK>"})
RESERVED_NAME = re.compile(r"reserved|unused|control|place_?holder|place▁holder", re.IGNORECASE)
_CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye."},
]
_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                          "parameters": {"type": "object", "properties": {}}}}
_TOOL_CHAT = [
    {"role": "user", "content": "Time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call0", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call0", "content": "noon"},
    {"role": "assistant", "content": "It is noon.", "reasoning_content": "The tool said noon."},
]
_PROBES = [
    (_CHAT, {"add_generation_prompt": True}),
    (_CHAT[1:], {"add_generation_prompt": True}),
    (_CHAT[:3], {"add_generation_prompt": False}),
    (_TOOL_CHAT, {"add_generation_prompt": False, "tools": [_TOOL]}),
]
"""Conversations whose rendering shows which ids the template writes (each in a try: a template may
refuse a shape, e.g. tools)."""


@dataclass(frozen=True, kw_only=True)
class MaskTokenChoice:
    """The chosen id, its token string (None for a row no token maps to) and how it was chosen."""

    token_id: int
    token: str | None
    source: str  # one of schemas.store.MASK_TOKEN_SOURCES

    def describe(self) -> str:
        return S.describe_mask_token(self.token_id, self.token, self.source)


def choose_mask_token(tokenizer: Any, vocab_size: int, explicit: int | None = None) -> MaskTokenChoice:
    """The store's mask token (module doc).

    Raises:
        UserError: ``explicit`` is outside the embedding or written by the chat template, or no
            automatic choice exists (the message names ``--mask-token-id`` and what was tried).
    """
    used = template_token_ids(tokenizer)
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise UserError(f"--mask-token-id {explicit} is outside the target's embedding (ids 0..{vocab_size - 1})")
        if explicit in used:
            raise UserError(f"--mask-token-id {explicit} is {_token(tokenizer, explicit)!r}, which the chat template "
                            "writes into every conversation; choose an id the data never uses")
        return MaskTokenChoice(token_id=explicit, token=_token(tokenizer, explicit), source=S.MASK_FROM_FLAG)

    tried = []
    mask_ids = sorted({i for i in [getattr(tokenizer, "mask_token_id", None)] if i is not None}
                      | {i for i, t in _added_tokens(tokenizer) if t.special and t.content in MASK_NAMES})
    for token_id in mask_ids:
        if token_id < vocab_size and token_id not in used:
            return MaskTokenChoice(token_id=token_id, token=_token(tokenizer, token_id), source=S.MASK_FROM_TOKENIZER)
    tried.append("the tokenizer has no usable mask token" if not mask_ids else
                 f"the tokenizer's mask token {mask_ids[0]} is outside the embedding or written by the template")

    highest = max(tokenizer.get_vocab().values())
    if highest + 1 < vocab_size:
        return MaskTokenChoice(token_id=highest + 1, token=None, source=S.MASK_FROM_UNUSED_ROW)
    tried.append(f"the embedding has no row past the tokenizer's highest id {highest} (vocab_size {vocab_size})")

    written = _template_literals(tokenizer)
    reserved = [i for i, t in _added_tokens(tokenizer)
                if t.special and RESERVED_NAME.search(t.content) and i < vocab_size and i not in used]
    if reserved:
        token_id = max(reserved)
        return MaskTokenChoice(token_id=token_id, token=_token(tokenizer, token_id), source=S.MASK_FROM_RESERVED)
    tried.append("the tokenizer has no reserved special token (reserved/unused/control names)")

    unused = [i for i, t in _added_tokens(tokenizer)
              if t.special and i < vocab_size and i not in used and t.content not in written]
    if unused:
        token_id = max(unused)
        return MaskTokenChoice(token_id=token_id, token=_token(tokenizer, token_id),
                               source=S.MASK_FROM_UNUSED_SPECIAL)
    tried.append("every added special token is written by the chat template or is BOS/EOS/PAD/UNK")
    raise UserError(f"cannot choose a mask token for this target: {'; '.join(tried)}. Pass --mask-token-id N "
                    f"with an id the data never uses; candidates: {_fallback_candidates(tokenizer, vocab_size)} "
                    "(records that contain it are skipped and counted; docs/mask.md)")


def _fallback_candidates(tokenizer: Any, vocab_size: int, count: int = 5) -> str:
    """Ids a user could pass when no automatic choice exists: regular tokens that never come out of
    encoding their own text (so the tokenizer never produces them from text), else the most recently
    merged ones (the rarest in the tokenizer's training corpus), highest ids first."""
    specials = {i for i, t in _added_tokens(tokenizer)}
    regular = [i for i in range(min(len(tokenizer), vocab_size) - 1, -1, -1) if i not in specials][:2000]
    texts = [tokenizer.decode([i]) for i in regular]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    unreachable = [i for i, ids in zip(regular, encoded) if ids != [i]]
    picked = (unreachable or regular)[:count]
    how = "never produced from their own text" if unreachable else "the last-merged, rarest tokens"
    return ", ".join(f"{i} {_token(tokenizer, i)!r}" for i in picked) + f" ({how})"


def template_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids the chat template writes into the probe conversations (plain, with a tool call and its
    result, with reasoning), and the BOS/EOS/PAD/UNK tokens."""
    ids = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk", "sep", "cls")}
    ids.discard(None)
    for messages, kwargs in _PROBES:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception:  # a template that refuses this shape of conversation says nothing here
            continue
        ids.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return frozenset(ids)


def _template_literals(tokenizer: Any) -> frozenset[str]:
    """Added tokens whose text occurs in the chat template's source: it may write them for
    conversations the probes do not exercise."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (default, tool_use, ...)
        template = "\n".join(template.values())
    return frozenset(t.content for _, t in _added_tokens(tokenizer) if t.content in template)


def _added_tokens(tokenizer: Any) -> list[tuple[int, Any]]:
    return sorted((getattr(tokenizer, "added_tokens_decoder", None) or {}).items())


def _token(tokenizer: Any, token_id: int) -> str | None:
    if token_id >= len(tokenizer):
        return None
    token = tokenizer.convert_ids_to_tokens(token_id)
    return token if isinstance(token, str) else None
