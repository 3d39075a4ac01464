"""A deterministic catalogue of malformed chat records, each with the skip reason extract must give it.

docs/reliability.md: a malformed record is skipped and counted, never turned into a silently wrong sample, and
never a traceback. ``bad_records()`` returns well over 200 JSONL lines that no chat pipeline should
train on: undecodable bytes, truncated or invalid JSON, values that are not objects, missing or
mistyped fields, unknown roles, empty and huge turns, conversations without a trainable assistant
turn, reserved tokens, and nested junk. Each carries the reason it should be counted under
(the strings of ``peagle.stages.extract.conversation.SKIP_REASONS``) or ``ANY`` where more than one
reason is defensible (then any skip will do, but it must be a skip).

``write_mixed_jsonl`` interleaves them with good records and also writes the *good-only twin*: the
same file with every bad line replaced by a blank line, so each good record keeps its line number
(and so its ``sample_id``, which hashes file name and record index) and every shard holds the same
good records. Extracting both must give the same samples, bit for bit.

Expectations assume the target reserves ``<|mask|>`` (the tiny targets do) and ``max_seq_len`` of
at most ``HUGE_CHARS // 8`` tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

ANY = "any"
HUGE_CHARS = 40_000  # a "huge" turn: far above any max_seq_len the suite uses, cheap to tokenize
MASK_TOKEN = "<|mask|>"


@dataclass(frozen=True)
class BadRecord:
    """One JSONL line (bytes, no newline) that extract must skip, and why."""

    name: str  # category/variant, unique
    line: bytes
    reason: str  # expected skip reason, or ANY


def _good_conversation(rng: random.Random) -> list[dict]:
    words = "alpha beta gamma delta shard store token model write read disk queue".split()

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "."

    return [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]


def _line(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def bad_records(seed: int = 0) -> list[BadRecord]:
    """The catalogue, in a fixed order (same seed -> same bytes)."""
    rng = random.Random(seed)
    out: list[BadRecord] = []

    def add(name: str, line: bytes | str | dict | list, reason: str) -> None:
        if isinstance(line, str):
            line = line.encode("utf-8")
        elif not isinstance(line, bytes):
            line = _line(line)
        assert b"\n" not in line, name
        out.append(BadRecord(f"{name}#{len(out)}", line, reason))

    def conv(**overrides) -> dict:
        return {"messages": _good_conversation(rng), **overrides}

    def msgs(*messages) -> dict:
        return {"messages": list(messages)}

    user = lambda: {"role": "user", "content": "What is a shard?"}  # noqa: E731
    assistant = lambda: {"role": "assistant", "content": "A slice of the store."}  # noqa: E731

    # --- bytes that are not UTF-8 (inside a string, in a key, outside any string, alone) ----------
    invalid = [b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\x80", b"\xc3",
               b"\xe2\x82", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xc1\xbf", b"\xbf\xbf\xbf"]
    for i, bad in enumerate(invalid):
        good = _line(conv()).replace(b"shard", b"sh" + bad + b"ard", 1)
        if bad not in good:  # the word did not occur: put it into the first content
            good = _line(conv()).replace(b'"content": "', b'"content": "' + bad, 1)
        add("invalid_utf8/in_string", good, "invalid_utf8")
        add("invalid_utf8/in_key", _line(conv()).replace(b'"messages"', b'"mess' + bad + b'ages"', 1), "invalid_utf8")
        if i % 2 == 0:
            add("invalid_utf8/outside_string", _line(conv()).replace(b"{", b"{" + bad, 1), "invalid_utf8")
    add("invalid_utf8/latin1_text", '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"),
        "invalid_utf8")
    add("invalid_utf8/utf16", json.dumps(conv()).encode("utf-16-le"), ANY)  # NUL bytes everywhere
    # Lone surrogates written as JSON escapes decode fine but are not text: no tokenizer can encode them.
    for esc in ("\\ud800", "\\udfff", "\\ud83d", "\\udc00x", "\\ud800\\ud800"):
        add("lone_surrogate/content", _line(msgs(user(), assistant())).replace(b"A slice", esc.encode() + b"A slice"),
            "invalid_utf8")
    add("lone_surrogate/role", '{"messages": [{"role": "us\\ud800er", "content": "hi"}, '
        '{"role": "assistant", "content": "yo"}]}', "invalid_utf8")

    # --- JSON that does not parse -------------------------------------------------------------------
    whole = _line(conv(system="Be brief."))
    cuts = sorted(rng.sample(range(1, len(whole) - 1), 24))
    for cut in cuts:
        add("truncated_json", whole[:cut], "malformed_json")
    for text in (
        "{'messages': [{'role': 'user', 'content': 'hi'}]}",  # single quotes
        '{"messages": [{"role": "user", "content": "hi"},]}',  # trailing comma
        '{"messages": [] // comment}',
        '{messages: []}',  # unquoted key
        '{"messages": [{"role": "user", "content": "hi"}]} trailing',
        '{"messages": []}{"messages": []}',  # two objects on one line
        '{"messages": []}\r{"messages": []}',  # a lone CR is not a line break
        '\ufeff{"messages": [{"role": "user", "content": "hi"}]}',  # BOM not on the first line
        '{"messages": [{"role": "user", "content": "tab\there"}]}',  # raw control character
        '{"messages": [{"role": "user", "content": "nul\x00here"}]}',
        '{"messages": [{"role": "user", "content": "esc\\qape"}]}',  # invalid escape
        '{"messages": [{"role": "user", "content": "\\u12"}]}',  # short unicode escape
        '{"messages": True}',  # Python literal
        '{"messages": None}',
        '{"a": 1, }',
        "{",
        "}",
        '"unterminated',
        "[" * 100_000,  # nesting far past any recursion limit
        '{"n": ' + "9" * 5000 + "}",  # integer past Python's 4300-digit conversion limit
        '{"messages": [{"role": "user", "content": "hi"}], "x": 0x10}',  # hex literal
        '{"messages": [{"role": "user", "content": "hi"}], "x": .5}',
        '{"messages": [{"role": "user", "content": "hi"}], "x": 01}',
        "<html><body>not json</body></html>",
        "messages: - role: user",  # YAML
    ):
        add("malformed_json", text, "malformed_json")

    # --- JSON values that are not objects -------------------------------------------------------------
    for value in ("[]", "[{\"role\": \"user\", \"content\": \"hi\"}]", '"a string"', "42", "-0.5", "null",
                  "true", "false", "[[[]]]", "1e400"):
        add("not_an_object", value, "not_an_object")

    # --- blank lines -------------------------------------------------------------------------------------
    for text in ("", " ", "\t", "   \t  ", "\r", "\x0b", "\x0c", " \r"):
        add("blank_line", text, "blank_line")

    # --- no conversation key -------------------------------------------------------------------------------
    for obj in ({}, {"msgs": [user(), assistant()]}, {"messages": None}, {"conversations": None},
                {"text": "What is a shard? A slice."}, {"Messages": [user(), assistant()]},
                {"prompt": "q", "completion": "a"}, {"messages ": [user(), assistant()]}):
        add("no_messages", obj, "no_messages")

    # --- the conversation is not a list / is empty ---------------------------------------------------------
    for value in ("hello", 5, 2.5, True, {}, {"role": "user", "content": "hi"}, {"0": user(), "1": assistant()}):
        add("messages_not_a_list", {"messages": value}, "messages_not_a_list")
    for value in ("human: hi", {"from": "human", "value": "hi"}):
        add("conversations_not_a_list", {"conversations": value}, "messages_not_a_list")
    add("empty_conversation", {"messages": []}, "empty_conversation")
    add("empty_conversation", {"conversations": []}, "empty_conversation")
    add("empty_conversation", {"conversations": [], "system": "Be brief."}, "empty_conversation")

    # --- a message that is not an object -------------------------------------------------------------------
    for junk in (1, None, "user: hi", ["user", "hi"], 3.5, True):
        add("message_not_an_object", msgs(user(), junk, assistant()), "message_not_an_object")
    add("message_not_an_object", {"conversations": [{"from": "human", "value": "hi"}, "gpt: hello"]},
        "message_not_an_object")
    add("message_not_an_object", {"conversations": [[{"from": "human", "value": "hi"}]]}, "message_not_an_object")

    # --- roles ---------------------------------------------------------------------------------------------------
    add("missing_role", msgs({"content": "hi"}, assistant()), "missing_role")
    add("missing_role", msgs(user(), {"content": "hello"}), "missing_role")
    add("missing_role", msgs({"role": None, "content": "hi"}, assistant()), "missing_role")
    add("missing_role", {"conversations": [{"value": "hi"}, {"from": "gpt", "value": "yo"}]}, "missing_role")
    add("missing_role", {"conversations": [{"from": None, "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        "missing_role")
    for role in ("bot", "ASSISTANT", "Assistant", "assistant ", " user", "", "human", "gpt", "function",
                 "model", "user\u200b", 5, 0, True, ["assistant"], {"name": "assistant"}):
        add("unknown_role", msgs(user(), {"role": role, "content": "A reply."}), "unknown_role")
    for speaker in ("bot", "function_call", "observation", "Human", "GPT", 3, ["human"]):
        add("unknown_role/sharegpt", {"conversations": [{"from": speaker, "value": "hi"},
                                                        {"from": "gpt", "value": "yo"}]}, "unknown_role")

    # --- content -----------------------------------------------------------------------------------------------
    add("missing_content", msgs({"role": "user"}, assistant()), "missing_content")
    add("missing_content", msgs(user(), {"role": "assistant"}), "missing_content")
    add("missing_content", msgs(user(), {"role": "assistant", "text": "A reply."}), "missing_content")
    add("missing_content", msgs(user(), {"role": "assistant", "tool_calls": [{"name": "f"}]}), "missing_content")
    add("missing_content", {"conversations": [{"from": "human"}, {"from": "gpt", "value": "yo"}]}, "missing_content")
    add("missing_content", {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "yo"}]},
        "missing_content")
    for content in (5, 2.5, True, None, {"text": "hi"}, ["a", "b"], [{"type": "image_url", "image_url": {"url": "x"}}],
                    [{"type": "text", "text": 5}], [{"type": "text"}], [{"text": "no type"}],
                    [{"type": "text", "text": "ok"}, {"type": "audio", "audio": "x"}], [None]):
        add("non_string_content/user", msgs({"role": "user", "content": content}, assistant()), "non_string_content")
    for content in (7, {"answer": "x"}, ["x"]):
        add("non_string_content/assistant", msgs(user(), {"role": "assistant", "content": content}),
            "non_string_content")
    add("non_string_content/reasoning", msgs(user(), {**assistant(), "reasoning_content": 5}), "non_string_content")
    add("non_string_content/reasoning", msgs(user(), {**assistant(), "reasoning_content": ["a"]}), "non_string_content")
    add("non_string_content/sharegpt", {"conversations": [{"from": "human", "value": 5},
                                                          {"from": "gpt", "value": "yo"}]}, "non_string_content")
    add("non_string_content/sharegpt_system", {"system": 5, "conversations": [{"from": "human", "value": "hi"},
                                                                             {"from": "gpt", "value": "yo"}]},
        "non_string_content")

    # --- empty turns ------------------------------------------------------------------------------------------------
    add("empty_assistant_turn", msgs(user(), {"role": "assistant", "content": ""}), "empty_assistant_turn")
    add("empty_assistant_turn", msgs(user(), {"role": "assistant", "content": []}), "empty_assistant_turn")
    add("empty_assistant_turn", msgs(user(), {"role": "assistant", "content": [{"type": "text", "text": ""}]}),
        "empty_assistant_turn")
    add("empty_assistant_turn", msgs(user(), {"role": "assistant", "content": None, "reasoning_content": ""}),
        "non_string_content")
    add("empty_assistant_turn", msgs(user(), assistant(), user(), {"role": "assistant", "content": ""}),
        "empty_assistant_turn")
    add("empty_assistant_turn/sharegpt", {"conversations": [{"from": "human", "value": "hi"},
                                                            {"from": "gpt", "value": ""}]}, "empty_assistant_turn")

    # --- tool calls and tools ---------------------------------------------------------------------------------------
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    add("bad_tool_calls", msgs({**user(), "tool_calls": [call]}, assistant()), "bad_tool_calls")
    for calls in ("f()", [1], {"name": "f"}, [None], [call, "g()"], 5):
        add("bad_tool_calls", msgs(user(), {**assistant(), "tool_calls": calls}), "bad_tool_calls")
    for tools in ("f", [1], {"name": "f"}, [None], 5, [{"type": "function"}, "g"]):
        add("bad_tools", {"messages": [user(), assistant()], "tools": tools}, "bad_tools")

    # --- nothing to train on ------------------------------------------------------------------------------------------
    add("no_assistant_turn", msgs(user()), "no_assistant_turn")
    add("no_assistant_turn", msgs({"role": "system", "content": "Be brief."}), "no_assistant_turn")
    add("no_assistant_turn", msgs(user(), user(), user()), "no_assistant_turn")
    add("no_assistant_turn", msgs(assistant()), "no_assistant_turn")
    add("no_assistant_turn", msgs(assistant(), user()), "no_assistant_turn")
    add("no_assistant_turn", msgs({"role": "tool", "content": "42"}), "no_assistant_turn")
    add("no_assistant_turn", {"conversations": [{"from": "human", "value": "hi"}]}, "no_assistant_turn")
    add("no_assistant_turn", {"conversations": [{"from": "gpt", "value": "hello"}]}, "no_assistant_turn")

    # --- the draft's reserved mask token in the text ----------------------------------------------------------------
    add("contains_mask_token", msgs({"role": "user", "content": f"fill {MASK_TOKEN} in"}, assistant()), "contains_mask_token")
    add("contains_mask_token", msgs(user(), {"role": "assistant", "content": f"it is {MASK_TOKEN}"}), "contains_mask_token")
    add("contains_mask_token", msgs({"role": "system", "content": MASK_TOKEN * 3}, user(), assistant()), "contains_mask_token")
    add("contains_mask_token", msgs(user(), {**assistant(), "reasoning_content": MASK_TOKEN}), "contains_mask_token")

    # --- huge turns: the assistant turn starts after max_seq_len ------------------------------------------------------
    huge_texts = {
        "words": " ".join(rng.choice(["store", "shard", "token", "model"]) for _ in range(HUGE_CHARS // 6)),
        "one_word": "x" * HUGE_CHARS,
        "cjk": "".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(HUGE_CHARS // 3)),
        "emoji": "\U0001F600\u200d\U0001F4BB " * (HUGE_CHARS // 8),
        "digits": "".join(rng.choice("0123456789") for _ in range(HUGE_CHARS)),
    }
    for kind, text in huge_texts.items():
        add(f"huge_user_turn/{kind}", msgs({"role": "user", "content": text}, assistant()), "truncated_no_loss")
    add("huge_system_turn", msgs({"role": "system", "content": huge_texts["words"]}, user(), assistant()),
        "truncated_no_loss")

    # --- nested junk -----------------------------------------------------------------------------------------------
    def nest(depth: int, leaf) -> object:
        for _ in range(depth):
            leaf = [leaf]
        return leaf

    add("nested_junk/content_list", msgs({"role": "user", "content": nest(50, "hi")}, assistant()),
        "non_string_content")
    add("nested_junk/content_dict", msgs({"role": "user", "content": {"a": {"b": {"c": ["hi"]}}}}, assistant()),
        "non_string_content")
    add("nested_junk/role", msgs({"role": {"role": {"role": "user"}}, "content": "hi"}, assistant()), "unknown_role")
    add("nested_junk/messages", {"messages": nest(30, [user(), assistant()])}, "message_not_an_object")
    add("nested_junk/message_in_message", msgs({"role": "user", "content": "hi", "message": msgs(user())}, {"x": 1}),
        "missing_role")
    add("nested_junk/conversations", {"conversations": {"conversations": {"conversations": []}}}, "messages_not_a_list")
    # Deep but valid JSON around the depth where parsing hits the recursion limit: whether decoding or
    # a later step hits it first, the record must be skipped (malformed_json or message_not_an_object).
    for depth in range(900, 1001, 4):
        add(f"nested_junk/deep_{depth}", '{"messages": ' + "[" * depth + "]" * depth + "}", ANY)
    for depth in (940, 960, 980, 995):
        add(f"nested_junk/deep_content_{depth}",
            '{"messages": [{"role": "user", "content": ' + "[" * depth + "]" * depth
            + '}, {"role": "assistant", "content": "yo"}]}', ANY)
    return out


@dataclass(frozen=True)
class MixedLayout:
    """Where things went in ``write_mixed_jsonl``'s files."""

    mixed: Path
    good_only: Path
    good_lines: list[int]  # 0-based line numbers of the good records (same in both files)
    bad_lines: dict[int, BadRecord]


def write_mixed_jsonl(directory: str | Path, good: list[dict], bad: list[BadRecord], *, seed: int = 0,
                      name: str = "chat.jsonl") -> MixedLayout:
    """Shuffle ``good`` (kept in order) and ``bad`` into ``directory/mixed/name``, and write the
    good-only twin ``directory/good/name`` with blank lines where the bad records were.

    The first line is always a good record (a BOM rule applies to line 1 only).
    """
    rng = random.Random(seed)
    kinds = ["good"] * (len(good) - 1) + ["bad"] * len(bad)
    rng.shuffle(kinds)
    kinds.insert(0, "good")
    mixed_lines, good_lines_text = [], []
    good_at, bad_at = [], {}
    gi = bi = 0
    for lineno, kind in enumerate(kinds):
        if kind == "good":
            text = _line(good[gi])
            gi += 1
            mixed_lines.append(text)
            good_lines_text.append(text)
            good_at.append(lineno)
        else:
            mixed_lines.append(bad[bi].line)
            good_lines_text.append(b"")
            bad_at[lineno] = bad[bi]
            bi += 1
    directory = Path(directory)
    paths = []
    for sub, lines in (("mixed", mixed_lines), ("good", good_lines_text)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
        path = directory / sub / name
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        paths.append(path)
    return MixedLayout(mixed=paths[0], good_only=paths[1], good_lines=good_at, bad_lines=bad_at)
