"""Turn one decoded chat record into OpenAI-style messages, or say exactly why it cannot be used.

Two input shapes are accepted (docs/reliability.md: a malformed record is skipped and counted, never turned
into a silently wrong sample):

* OpenAI: ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?}``. Every other key of
  a message (``reasoning_content``, ``tool_calls``, ``name``, ``tool_call_id``, ...) is passed through
  to the chat template unchanged; a key whose value is ``None`` counts as absent, because Parquet
  struct columns give every message every field of the column.
* ShareGPT: ``{"conversations": [{"from": ..., "value": ...}, ...], "system": "..."?}`` with the roles
  in ``SHAREGPT_ROLES``.

Content must be a string. A list of OpenAI text parts (``[{"type": "text", "text": ...}]``) is joined
into one string, as OpenAI does; any other part (an image) makes the record unusable. An assistant
message with ``tool_calls`` may have ``None`` content: it becomes ``""``, because Jinja would render
``None`` as the text "None".

Every skip reason is a fixed string constant below; the manifest counts records by these strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Decoding (set by readers.py).
MALFORMED_JSON = "malformed_json"
INVALID_UTF8 = "invalid_utf8"
NOT_AN_OBJECT = "not_an_object"
BLANK_LINE = "blank_line"
TOO_LARGE = "too_large"  # more bytes than --max-record-bytes: never decoded
# Structure (set here).
NO_MESSAGES = "no_messages"
MESSAGES_NOT_A_LIST = "messages_not_a_list"
EMPTY_CONVERSATION = "empty_conversation"
MESSAGE_NOT_AN_OBJECT = "message_not_an_object"
MISSING_ROLE = "missing_role"
UNKNOWN_ROLE = "unknown_role"
MISSING_CONTENT = "missing_content"
NON_STRING_CONTENT = "non_string_content"
EMPTY_ASSISTANT_TURN = "empty_assistant_turn"
BAD_TOOL_CALLS = "bad_tool_calls"
BAD_TOOLS = "bad_tools"
NO_ASSISTANT_TURN = "no_assistant_turn"
# Templating and tokenization (set by template.py).
TEMPLATE_ERROR = "template_error"
TEMPLATE_PREFIX_MISMATCH = "template_prefix_mismatch"
EMPTY_AFTER_TEMPLATE = "empty_after_template"
CONTAINS_MASK_TOKEN = "contains_mask_token"  # the draft's mask token occurs in the rendered record
TRUNCATED_NO_LOSS = "truncated_no_loss"

SKIP_REASONS: tuple[str, ...] = (
    MALFORMED_JSON, INVALID_UTF8, NOT_AN_OBJECT, BLANK_LINE, TOO_LARGE,
    NO_MESSAGES, MESSAGES_NOT_A_LIST, EMPTY_CONVERSATION, MESSAGE_NOT_AN_OBJECT, MISSING_ROLE,
    UNKNOWN_ROLE, MISSING_CONTENT, NON_STRING_CONTENT, EMPTY_ASSISTANT_TURN, BAD_TOOL_CALLS, BAD_TOOLS,
    NO_ASSISTANT_TURN,
    TEMPLATE_ERROR, TEMPLATE_PREFIX_MISMATCH, EMPTY_AFTER_TEMPLATE, CONTAINS_MASK_TOKEN, TRUNCATED_NO_LOSS,
)

OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# ShareGPT speaker -> OpenAI role. "function_call"/"observation" are not mapped: rendering a tool call
# as plain assistant text would silently train the wrong format.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
}


class SkipRecord(Exception):
    """Raised for a record that cannot become a sample: ``reason`` is one of ``SKIP_REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, kw_only=True)
class Conversation:
    """A validated conversation, ready for ``tokenizer.apply_chat_template``.

    ``trainable_turns`` are the indices of assistant messages that can carry loss: every assistant
    message except one that opens the conversation (no prompt precedes it, and chat templates refuse
    to render an empty conversation, so its start cannot be located).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    trainable_turns: list[int]


def normalise_record(raw: dict[str, Any], *, to_regenerate: bool = False) -> Conversation:
    """Validate a decoded record and return its messages in OpenAI form.

    With ``to_regenerate`` (``--regenerate``: the target writes every assistant turn anew) a record
    may be prompts only: empty assistant turns are kept, to be written, and a conversation that ends
    with a user turn gets an empty assistant turn after it (so ``{"messages": [{"role": "user",
    ...}]}`` is a complete record).

    Raises:
        SkipRecord: the record is unusable; ``reason`` says why.
    """
    tools = raw.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise SkipRecord(BAD_TOOLS, "'tools' must be a list of objects")
    if raw.get("messages") is not None:
        messages = [_openai_message(m, i, to_regenerate) for i, m in enumerate(_message_list(raw["messages"], "messages"))]
    elif raw.get("conversations") is not None:
        turns = _message_list(raw["conversations"], "conversations")
        messages = [_sharegpt_message(m, i, to_regenerate) for i, m in enumerate(turns)]
        system = raw.get("system")
        if system is not None and not (messages and messages[0]["role"] == "system"):
            if not isinstance(system, str):
                raise SkipRecord(NON_STRING_CONTENT, "'system' is not a string")
            if system:
                messages.insert(0, {"role": "system", "content": system})
    else:
        raise SkipRecord(NO_MESSAGES, "record has neither 'messages' nor 'conversations'")
    if to_regenerate and messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": ""})
    trainable = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if not trainable:
        raise SkipRecord(NO_ASSISTANT_TURN, "no assistant message after the first message")
    return Conversation(messages=messages, tools=tools or None, trainable_turns=trainable)


def _message_list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise SkipRecord(MESSAGES_NOT_A_LIST, f"'{key}' is a {type(value).__name__}, not a list")
    if not value:
        raise SkipRecord(EMPTY_CONVERSATION, f"'{key}' is empty")
    return value


def _openai_message(message: Any, position: int, to_regenerate: bool = False) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise SkipRecord(MESSAGE_NOT_AN_OBJECT, f"message {position} is a {type(message).__name__}")
    out = {key: value for key, value in message.items() if value is not None}
    role = out.get("role")
    if role is None:
        raise SkipRecord(MISSING_ROLE, f"message {position} has no 'role'")
    if not isinstance(role, str) or role not in OPENAI_ROLES:
        raise SkipRecord(UNKNOWN_ROLE, f"message {position} has role {role!r}")
    tool_calls = out.get("tool_calls")
    if tool_calls == []:  # exported datasets often carry an empty list on plain turns
        del out["tool_calls"]
        tool_calls = None
    if tool_calls is not None:
        if role != "assistant" or not (
            isinstance(tool_calls, list) and tool_calls and all(isinstance(c, dict) for c in tool_calls)
        ):
            raise SkipRecord(BAD_TOOL_CALLS, f"message {position}: 'tool_calls' must be a non-empty list "
                             "of objects on an assistant message")
    if "content" not in message:
        raise SkipRecord(MISSING_CONTENT, f"message {position} has no 'content'")
    content = message["content"]
    if content is None and tool_calls is not None:
        content = ""
    out["content"] = _content_text(content, position)
    reasoning = out.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise SkipRecord(NON_STRING_CONTENT, f"message {position}: 'reasoning_content' is not a string")
    # Whitespace-only turns would train the draft to propose a lone newline after every prompt.
    if role == "assistant" and not to_regenerate and not (out["content"].strip() or (reasoning or "").strip()
                                                          or tool_calls):
        raise SkipRecord(EMPTY_ASSISTANT_TURN, f"message {position} is an empty assistant turn")
    return out


def _sharegpt_message(message: Any, position: int, to_regenerate: bool = False) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise SkipRecord(MESSAGE_NOT_AN_OBJECT, f"turn {position} is a {type(message).__name__}")
    speaker = message.get("from")
    if speaker is None:
        raise SkipRecord(MISSING_ROLE, f"turn {position} has no 'from'")
    role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
    if role is None:
        raise SkipRecord(UNKNOWN_ROLE, f"turn {position} is from {speaker!r}")
    if message.get("value") is None:
        raise SkipRecord(MISSING_CONTENT, f"turn {position} has no 'value'")
    content = _content_text(message["value"], position)
    if role == "assistant" and not to_regenerate and not content.strip():
        raise SkipRecord(EMPTY_ASSISTANT_TURN, f"turn {position} is an empty assistant turn")
    extras = {k: v for k, v in message.items() if k not in ("from", "value") and v is not None}
    return {**extras, "role": role, "content": content}


def _content_text(content: Any, position: int) -> str:
    """A string, or a list of text parts joined (OpenAI's own reading of such a list)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise SkipRecord(NON_STRING_CONTENT, f"message {position}: content is a {type(content).__name__}, "
                     "not a string or a list of text parts")
