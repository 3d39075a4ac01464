"""Conversation normalisation: OpenAI and ShareGPT in, OpenAI messages out, every skip reason."""

from __future__ import annotations

import pytest

from peagle.schemas import store as S
from peagle.stages.extract import conversation as conv
from peagle.stages.extract.conversation import SkipRecord, normalise_record


def test_openai_passes_template_fields_through_and_drops_nones():
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    raw = {
        "messages": [
            {"role": "system", "content": "sys", "name": None},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "why"},
            {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
            {"role": "assistant", "content": "done", "tool_calls": []},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }

    c = normalise_record(raw)

    assert c.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "why"},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
        {"role": "assistant", "content": "done"},
    ]
    assert c.tools == raw["tools"]
    assert c.trainable_turns == [2, 4]
    assert raw["messages"][2]["content"] is None  # the record itself is not modified


def test_sharegpt_maps_roles_and_top_level_system():
    raw = {
        "system": "be brief",
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "user", "value": "more"},
            {"from": "chatgpt", "value": "sure"},
        ],
    }
    c = normalise_record(raw)
    assert c.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "sure"},
    ]
    assert c.trainable_turns == [2, 4]
    assert c.tools is None


def test_messages_wins_over_a_null_conversations_column():
    raw = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
           "conversations": None}
    assert normalise_record(raw).trainable_turns == [1]


def test_leading_assistant_turn_is_context_only():
    raw = {"messages": [{"role": "assistant", "content": "welcome"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"}]}
    assert normalise_record(raw).trainable_turns == [2]


U = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    "raw, reason",
    [
        ({"text": "hello"}, "no_messages"),
        ({"messages": None, "conversations": None}, "no_messages"),
        ({"messages": "hi"}, "messages_not_a_list"),
        ({"conversations": {"from": "human"}}, "messages_not_a_list"),
        ({"messages": []}, "empty_conversation"),
        ({"conversations": []}, "empty_conversation"),
        ({"messages": [U, "assistant: a"]}, "message_not_an_object"),
        ({"conversations": [["human", "q"]]}, "message_not_an_object"),
        ({"messages": [U, {"content": "a"}]}, "missing_role"),
        ({"messages": [U, {"role": None, "content": "a"}]}, "missing_role"),
        ({"conversations": [{"value": "q"}]}, "missing_role"),
        ({"messages": [U, {"role": "bot", "content": "a"}]}, "unknown_role"),
        ({"messages": [U, {"role": 3, "content": "a"}]}, "unknown_role"),
        ({"messages": [U, {"role": ["assistant"], "content": "a"}]}, "unknown_role"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "bard", "value": "a"}]}, "unknown_role"),
        ({"conversations": [{"from": "function_call", "value": "{}"}]}, "unknown_role"),
        ({"messages": [U, {"role": "assistant"}]}, "missing_content"),
        ({"messages": [{"role": "user", "content": None}, A]}, "non_string_content"),
        ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}, "missing_content"),
        ({"messages": [{"role": "user", "content": 7}, A]}, "non_string_content"),
        ({"messages": [U, {"role": "assistant", "content": {"text": "a"}}]}, "non_string_content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, A]},
         "non_string_content"),
        ({"messages": [U, {"role": "assistant", "content": "a", "reasoning_content": 1}]}, "non_string_content"),
        ({"conversations": [{"from": "human", "value": ["q"]}, {"from": "gpt", "value": "a"}]},
         "non_string_content"),
        ({"system": 5, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
         "non_string_content"),
        ({"messages": [U, {"role": "assistant", "content": ""}]}, "empty_assistant_turn"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}, "empty_assistant_turn"),
        ({"messages": [U, {"role": "assistant", "content": "a", "tool_calls": "f()"}]}, "bad_tool_calls"),
        ({"messages": [U, {"role": "assistant", "content": "a", "tool_calls": ["f()"]}]}, "bad_tool_calls"),
        ({"messages": [{"role": "user", "content": "q", "tool_calls": [{}]}, A]}, "bad_tool_calls"),
        ({"messages": [U, A], "tools": "f"}, "bad_tools"),
        ({"messages": [U, A], "tools": ["f"]}, "bad_tools"),
        ({"messages": [U, {"role": "user", "content": "again"}]}, "no_assistant_turn"),
        ({"messages": [A, U]}, "no_assistant_turn"),
        ({"conversations": [{"from": "system", "value": "s"}]}, "no_assistant_turn"),
    ],
)
def test_skip_reasons(raw, reason):
    with pytest.raises(SkipRecord) as info:
        normalise_record(raw)
    assert info.value.reason == reason
    assert reason in conv.SKIP_REASONS


def test_skip_reasons_are_unique_snake_case_strings():
    assert len(set(conv.SKIP_REASONS)) == len(conv.SKIP_REASONS)
    assert all(r.replace("_", "").isalnum() and r.islower() for r in conv.SKIP_REASONS)
    assert not set(conv.SKIP_REASONS) & set(S.SAMPLE_DROPS)  # `store info` counts records by them
    with pytest.raises(AssertionError):
        SkipRecord("not_a_known_reason")
