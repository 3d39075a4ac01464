"""Chat templating and loss masks on the real tiny-target tokenizers (llama and qwen3 templates)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from peagle.schemas.errors import UserError
from peagle.stages.extract.conversation import SKIP_REASONS
from peagle.stages.extract.readers import SourceRecord, decode_jsonl_line, iter_file_records
from peagle.stages.extract.template import make_sample_id, prepare_record
from peagle.demo.tiny_target import MASK_TOKEN, TinyTargetSpec, build_tiny_target

ARCHS = ("llama", "qwen3")
END_OF_TURN = {"llama": "<|eot_id|>", "qwen3": "<|im_end|>"}


@pytest.fixture(scope="module")
def target_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_targets")
    return {arch: build_tiny_target(root / arch, TinyTargetSpec(arch=arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def tokenizers(target_dirs) -> dict[str, object]:
    return {arch: AutoTokenizer.from_pretrained(path) for arch, path in target_dirs.items()}


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


def _record(raw, index: int = 0, name: str = "data.jsonl") -> SourceRecord:
    return SourceRecord(Path("/some/dir") / name, index, raw)


def _loss_spans(sample) -> list[list[int]]:
    """Contiguous runs of loss-masked token ids."""
    runs, current = [], []
    for token, bit in zip(sample.input_ids, sample.loss_mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "weather"}}}
MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there, who are you?"},
        {"role": "assistant", "content": "An assistant. Ask away.", "reasoning_content": "Greet briefly."},
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny: héllo 日本 🙂."},
        {"role": "user", "content": "Thanks!"},  # after the last assistant turn: cut
    ]
}
ASSISTANT_TEXTS = [
    "<think>Greet briefly.</think>An assistant. Ask away.",
    "<tool_call>" + json.dumps(CALL) + "</tool_call>",
    "It is sunny: héllo 日本 🙂.",
]


def test_all_mode_spans_are_exactly_the_assistant_tokens_plus_end_of_turn(tokenizers, arch):
    tok = tokenizers[arch]
    prepared = prepare_record(_record(MULTI_TURN, 4), tok, max_seq_len=4096)

    assert prepared.skip_reason is None and prepared.num_truncated == 0
    [sample] = prepared.samples
    assert sample.source == "data.jsonl:4"
    # Same ids as the template's own tokenization of the conversation cut after the last assistant.
    expected_ids = tok.apply_chat_template(MULTI_TURN["messages"][:7], tokenize=True)["input_ids"]
    assert sample.input_ids == list(expected_ids)
    # Each loss span is the assistant's rendered text followed by the end-of-turn token, token for token.
    eot = END_OF_TURN[arch]
    assert _loss_spans(sample) == [_encode(tok, text + eot) for text in ASSISTANT_TEXTS]
    assert [tok.decode(s) for s in _loss_spans(sample)] == [text + eot for text in ASSISTANT_TEXTS]
    # Reasoning and tool calls reached the template as their special tokens.
    for special in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tok.convert_tokens_to_ids(special) in sample.input_ids


def test_end_of_turn_in_loss_and_trailing_newline_not(tokenizers):
    tok = tokenizers["qwen3"]
    raw = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    [sample] = prepare_record(_record(raw), tok, max_seq_len=4096).samples
    # ChatML ends a turn with "<|im_end|>\n": the target stops at <|im_end|> and never emits the "\n".
    assert tok.convert_ids_to_tokens(sample.input_ids[-2:]) == ["<|im_end|>", "Ċ"]
    assert sample.loss_mask[-2:] == [1, 0]


def test_last_mode_trains_only_the_last_turn(tokenizers, arch):
    tok = tokenizers[arch]
    all_turns = prepare_record(_record(MULTI_TURN), tok, max_seq_len=4096).samples[0]
    [last] = prepare_record(_record(MULTI_TURN), tok, loss_on="last", max_seq_len=4096).samples
    assert last.input_ids == all_turns.input_ids
    assert _loss_spans(last) == [_encode(tok, ASSISTANT_TEXTS[-1] + END_OF_TURN[arch])]


def test_per_turn_mode_one_prefix_sample_per_turn(tokenizers, arch):
    tok = tokenizers[arch]
    prepared = prepare_record(_record(MULTI_TURN, 9), tok, loss_on="per_turn", max_seq_len=4096)

    assert len(prepared.samples) == 3
    assert len({s.sample_id for s in prepared.samples}) == 3
    for sample, turn, text in zip(prepared.samples, (2, 4, 6), ASSISTANT_TEXTS):
        expected_ids = tok.apply_chat_template(MULTI_TURN["messages"][: turn + 1], tokenize=True)["input_ids"]
        assert sample.input_ids == list(expected_ids)
        assert _loss_spans(sample) == [_encode(tok, text + END_OF_TURN[arch])]
        assert sample.source == "data.jsonl:9"


def test_sharegpt_equals_the_same_openai_conversation(tokenizers, arch):
    tok = tokenizers[arch]
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"},
                                  {"from": "gpt", "value": "ciao"}]}
    openai = {"messages": [{"role": r, "content": c} for r, c in
                           [("system", "s"), ("user", "hi"), ("assistant", "hello"), ("user", "bye"),
                            ("assistant", "ciao")]]}
    [a] = prepare_record(_record(sharegpt), tok, max_seq_len=4096).samples
    [b] = prepare_record(_record(openai), tok, max_seq_len=4096).samples
    assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)
    assert a.sample_id != b.sample_id  # different records


def test_truncation_is_counted_and_a_sample_without_loss_is_skipped(tokenizers, arch):
    tok = tokenizers[arch]
    [full] = prepare_record(_record(MULTI_TURN), tok, max_seq_len=4096).samples
    first_loss = full.loss_mask.index(1)

    cut = prepare_record(_record(MULTI_TURN), tok, max_seq_len=first_loss + 3)
    assert cut.num_truncated == 1
    [sample] = cut.samples
    assert sample.input_ids == full.input_ids[: first_loss + 3]
    assert sample.loss_mask == full.loss_mask[: first_loss + 3]
    assert sample.sample_id == full.sample_id

    nothing = prepare_record(_record(MULTI_TURN), tok, max_seq_len=first_loss)
    assert (nothing.samples, nothing.skip_reason) == ([], "truncated_no_loss")

    # per_turn: later turns whose loss lies past the limit are dropped, earlier ones kept.
    per_turn = prepare_record(_record(MULTI_TURN), tok, loss_on="per_turn", max_seq_len=first_loss + 3)
    assert len(per_turn.samples) == 1 and per_turn.num_truncated == 1 and per_turn.num_dropped == 2
    assert per_turn.skip_reason is None


def test_sample_ids_are_stable_across_runs_and_directories(tmp_path, tokenizers):
    tok = tokenizers["llama"]
    lines = [json.dumps(MULTI_TURN), json.dumps({"messages": MULTI_TURN["messages"][:3]})]
    for folder in ("run1", "run2"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "chats.jsonl").write_text("\n".join(lines) + "\n")

    def ids(folder: str, loss_on: str) -> list[str]:
        out = []
        for record in iter_file_records(tmp_path / folder / "chats.jsonl"):
            out += [s.sample_id for s in prepare_record(record, tok, loss_on=loss_on, max_seq_len=4096).samples]
        return out

    assert ids("run1", "all") == ids("run2", "all")
    assert ids("run1", "per_turn") == ids("run2", "per_turn")
    assert len(set(ids("run1", "per_turn"))) == 4
    # Pinned: sha256 is the same on every machine, so this value never changes.
    assert make_sample_id("chats.jsonl", 3, -1, '{"a":1}') == "caed8250b37476377624"
    assert make_sample_id("chats.jsonl", 3, 2, '{"a":1}') != make_sample_id("chats.jsonl", 3, -1, '{"a":1}')
    assert make_sample_id("chats.jsonl", 4, -1, '{"a":1}') != make_sample_id("chats.jsonl", 3, -1, '{"a":1}')


def test_every_skip_reason_from_real_files(tmp_path, tokenizers, arch):
    tok = tokenizers[arch]
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    lines = [
        (json.dumps(good).encode(), None),
        (b'{"messages": [{"role": "user"', "malformed_json"),
        (b'{"messages": "\xff\xfe"}', "invalid_utf8"),
        (b'["not", "an", "object"]', "not_an_object"),
        (b"", "blank_line"),
        (json.dumps({"messages": [{"role": "user", "content": "q"}, {"content": "a"}]}).encode(), "missing_role"),
        (json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}).encode(),
         "unknown_role"),
        (json.dumps({"messages": []}).encode(), "empty_conversation"),
        (json.dumps({"messages": [{"role": "user", "content": 1}, good["messages"][1]]}).encode(),
         "non_string_content"),
        (json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode(), "no_assistant_turn"),
        (json.dumps({"prompt": "q", "completion": "a"}).encode(), "no_messages"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}',
         "invalid_utf8"),
        (json.dumps({"messages": [{"role": "user", "content": f"say {MASK_TOKEN}"}, good["messages"][1]]}).encode(),
         "contains_mask_token"),
    ]
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_bytes(b"\n".join(line for line, _ in lines) + b"\n")
    parquet = tmp_path / "sharegpt.parquet"
    rows = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"conversations": [{"from": "human", "value": "q"}, {"from": "wizard", "value": "a"}]}]
    pq.write_table(pa.Table.from_pylist(rows), parquet)

    forbidden = frozenset({tok.convert_tokens_to_ids(MASK_TOKEN)})
    results = [prepare_record(r, tok, max_seq_len=64, mask_token_id=next(iter(forbidden)))
               for path in (jsonl, parquet) for r in iter_file_records(path)]

    assert [r.skip_reason for r in results] == [reason for _, reason in lines] + [None, "unknown_role"]
    for result in results:
        assert bool(result.samples) == (result.skip_reason is None)
        assert (result.skip_detail is None) == (result.skip_reason is None)


# A Qwen3-style template: an assistant turn's reasoning is shown only after the last user message.
HISTORY_REWRITING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and loop.index0 > ns.last_user and message.reasoning_content %}"
    "{{- '<think>' + message.reasoning_content + '</think>' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A DeepSeek-R1-style template: the generation prompt opens a think block the rendered turn lacks.
THINKING_PROMPT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@pytest.fixture
def qwen_with_template(target_dirs):
    def make(template: str):
        tok = AutoTokenizer.from_pretrained(target_dirs["qwen3"])
        tok.chat_template = template
        return tok
    return make


def test_history_rewriting_template(qwen_with_template):
    tok = qwen_with_template(HISTORY_REWRITING_TEMPLATE)
    raw = {"messages": [{"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                        {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]}

    last = prepare_record(_record(raw), tok, loss_on="last", max_seq_len=4096)
    assert [tok.decode(s) for s in _loss_spans(last.samples[0])] == ["<think>r2</think>a2<|im_end|>"]
    per_turn = prepare_record(_record(raw), tok, loss_on="per_turn", max_seq_len=4096)
    assert [[tok.decode(s) for s in _loss_spans(x)] for x in per_turn.samples] == [
        ["<think>r1</think>a1<|im_end|>"], ["<think>r2</think>a2<|im_end|>"],
    ]
    # "all": the whole conversation's text drops r1, so turn 1 cannot be located in it; the record is
    # rendered turn by turn instead (the text the target sees when it writes each turn), and says so.
    every = prepare_record(_record(raw), tok, max_seq_len=4096)
    assert every.rendered_per_turn and not per_turn.rendered_per_turn
    assert [(s.sample_id, s.input_ids, s.loss_mask) for s in every.samples] == \
        [(s.sample_id, s.input_ids, s.loss_mask) for s in per_turn.samples]


def test_generation_prompt_that_diverges_from_the_rendered_turn(qwen_with_template):
    tok = qwen_with_template(THINKING_PROMPT_TEMPLATE)
    raw = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "plain answer"},
                        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "<think>\nhm</think>ok"}]}
    [sample] = prepare_record(_record(raw), tok, max_seq_len=4096).samples
    # Loss starts where the rendered turn departs from the prompt: the prompt's "<think>\n" is context.
    assert [tok.decode(s) for s in _loss_spans(sample)] == ["plain answer<|im_end|>", "hm</think>ok<|im_end|>"]


def test_failing_template_is_a_skip(qwen_with_template):
    tok = qwen_with_template("{{ raise_exception('roles must alternate') }}")
    raw = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    prepared = prepare_record(_record(raw), tok, max_seq_len=4096)
    assert prepared.skip_reason == "template_error" and "roles must alternate" in prepared.skip_detail


def test_template_that_drops_assistant_text_is_a_skip(qwen_with_template):
    tok = qwen_with_template("{%- for m in messages %}{%- if m.role != 'assistant' %}{{ m.content }}{%- endif %}"
                             "{%- endfor %}")
    raw = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert prepare_record(_record(raw), tok, max_seq_len=4096).skip_reason == "empty_after_template"


def test_bad_settings_are_user_errors(tokenizers):
    record = _record({"messages": []})
    with pytest.raises(UserError, match="loss_on"):
        prepare_record(record, tokenizers["llama"], loss_on="first", max_seq_len=16)
    with pytest.raises(UserError, match="max_seq_len"):
        prepare_record(record, tokenizers["llama"], max_seq_len=1)


# --- property test: junk never raises; anything that is not skipped is a well-formed sample ---

# Mostly plausible values, sometimes hostile ones, so that both samples and every skip path occur.
_PLAIN = st.text(max_size=12)
_HOSTILE = st.sampled_from(["", " ", "\n", "\ud800", MASK_TOKEN, "<|eot_id|>", "<|im_end|>", "<think>", "{{ x }}"])
_TEXT = st.one_of(_PLAIN, _PLAIN, _PLAIN, _HOSTILE)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_PLAIN, children, max_size=3),
    max_leaves=6,
)
_OBJECTS = st.lists(st.dictionaries(_PLAIN, _JSON, max_size=2), min_size=1, max_size=2)
_ROLE = st.sampled_from(["user", "assistant"] * 10 + ["system", "tool", "developer", "bot", "", None, 3])
_SPEAKER = st.sampled_from(["human", "gpt"] * 10 + ["system", "user", "chatgpt", "tool", "bard", None])
_PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2)
_CONTENT = st.one_of(_PLAIN, _PLAIN, _PLAIN, _TEXT, _JSON, _PARTS)
_MESSY_MESSAGE = st.fixed_dictionaries(
    {"role": _ROLE, "content": _CONTENT},
    optional={"reasoning_content": _TEXT | _JSON, "tool_calls": _OBJECTS | _OBJECTS | _JSON, "name": _TEXT},
)
_OPENAI_MESSAGE = st.one_of(st.fixed_dictionaries({"role": _ROLE, "content": _PLAIN}), _MESSY_MESSAGE)
_SHAREGPT_TURN = st.one_of(st.fixed_dictionaries({"from": _SPEAKER, "value": _PLAIN}),
                           st.fixed_dictionaries({"from": _SPEAKER, "value": _CONTENT}))
_WORDS = st.text(min_size=1, max_size=16)
_VALID = st.lists(st.tuples(_WORDS | _TEXT, _WORDS | _TEXT), min_size=1, max_size=3).map(
    lambda turns: {"messages": [{"role": role, "content": text} for pair in turns
                                for role, text in zip(("user", "assistant"), pair)]}
)
_RECORD = st.one_of(
    _VALID,
    _VALID,
    st.fixed_dictionaries({"messages": st.lists(_OPENAI_MESSAGE, max_size=5)}, optional={"tools": _OBJECTS}),
    st.fixed_dictionaries({"messages": st.lists(_OPENAI_MESSAGE | _JSON, max_size=4)}, optional={"tools": _JSON}),
    st.fixed_dictionaries({"conversations": st.lists(_SHAREGPT_TURN, max_size=5)}, optional={"system": _TEXT}),
    st.dictionaries(_TEXT, _JSON, max_size=3),
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_RECORD, loss_on=st.sampled_from(["all", "last", "per_turn"]),
       max_seq_len=st.integers(2, 64) | st.just(2048))
def test_junk_records_never_raise(tokenizers, raw, loss_on, max_seq_len):
    tok = tokenizers["llama"]
    forbidden = frozenset({tok.convert_tokens_to_ids(MASK_TOKEN)})
    prepared = prepare_record(_record(raw), tok, loss_on=loss_on, max_seq_len=max_seq_len,
                              mask_token_id=next(iter(forbidden)))
    _check_prepared(prepared, max_seq_len, forbidden)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=st.binary(max_size=40) | _RECORD.map(lambda r: json.dumps(r).encode()))
def test_junk_lines_never_raise(tokenizers, line):
    tok = tokenizers["qwen3"]
    raw, error = decode_jsonl_line(line)
    prepared = prepare_record(SourceRecord(Path("x.jsonl"), 0, raw, error), tok, max_seq_len=32)
    _check_prepared(prepared, 32, frozenset())


def _check_prepared(prepared, max_seq_len: int, forbidden: frozenset[int]) -> None:
    if prepared.skip_reason is not None:
        assert prepared.skip_reason in SKIP_REASONS and not prepared.samples
        return
    assert prepared.samples
    for sample in prepared.samples:
        assert 0 < len(sample.input_ids) == len(sample.loss_mask) <= max_seq_len
        assert set(sample.loss_mask) <= {0, 1} and any(sample.loss_mask)
        assert forbidden.isdisjoint(sample.input_ids)
        assert len(sample.sample_id) == 20 and int(sample.sample_id, 16) >= 0


def test_tokenizer_without_chat_template_is_a_user_error(qwen_with_template):
    tok = qwen_with_template(None)
    raw = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(UserError, match="chat template"):
        prepare_record(_record(raw), tok, max_seq_len=16)
