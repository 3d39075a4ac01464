"""Loss masks on tokenizers and chat templates shaped like Llama-3.1, Qwen3 and Mistral: exactly each
trained assistant turn's rendered text (reasoning block and tool calls included) plus its end-of-turn
token, never system, user or tool text, headers or generation prompts.

The expected supervised text of every turn is written out literally per family below; the expected
mask is rebuilt from it independently (find each string in the rendered text, mark the tokens that
overlap it) and compared token by token with what extraction produced.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from peagle.stages.extract.readers import SourceRecord
from peagle.stages.extract.template import prepare_record

TOOLS = [{"type": "function", "function": {"name": "search_docs", "description": "Search the docs.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
CALL = {"id": "call00001", "type": "function", "function": {"name": "search_docs", "arguments": {"query": "mask token"}}}
CONVERSATION = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Find the mask token docs."},
    {"role": "assistant", "content": "", "reasoning_content": "The docs will say.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "content": "It is chosen once."},
    {"role": "assistant", "content": "It is chosen once per store.", "reasoning_content": "Quote the result."},
    {"role": "user", "content": "Thanks. Anything else?"},
    {"role": "assistant", "content": "No, that is all.", "reasoning_content": "Nothing more."},
]}

# The supervised text of each sample, per family. Llama-3.1 renders no reasoning and a call as JSON
# with "parameters"; Mistral's answers start with the space the model writes after [/INST]; Qwen3
# rewrites history, so its record becomes one sample per turn, each rendered as the target sees it.
EXPECTED = {
    "llama3": [[
        '{"name": "search_docs", "parameters": {"query": "mask token"}}<|eot_id|>',
        "It is chosen once per store.<|eot_id|>",
        "No, that is all.<|eot_id|>",
    ]],
    "qwen3": [
        ['<think>\nThe docs will say.\n</think>\n\n<tool_call>\n{"name": "search_docs", "arguments": '
         '{"query": "mask token"}}\n</tool_call><|im_end|>'],
        ["<think>\nQuote the result.\n</think>\n\nIt is chosen once per store.<|im_end|>"],
        ["<think>\nNothing more.\n</think>\n\nNo, that is all.<|im_end|>"],
    ],
    "mistral": [[
        '[TOOL_CALLS] [{"name": "search_docs", "arguments": {"query": "mask token"}}]</s>',
        " It is chosen once per store.</s>",
        " No, that is all.</s>",
    ]],
}
REASONING = ["The docs will say.", "Quote the result.", "Nothing more."]
FAMILIES = sorted(EXPECTED)


@pytest.fixture(scope="module")
def tokenizers(family_target):
    return {family: AutoTokenizer.from_pretrained(family_target(family)) for family in FAMILIES}


def _prepare(tokenizer, raw=CONVERSATION, **kwargs):
    prepared = prepare_record(SourceRecord(Path("chats.jsonl"), 0, raw), tokenizer, max_seq_len=8192, **kwargs)
    assert prepared.skip_reason is None, prepared.skip_detail
    return prepared


def _text_and_offsets(tokenizer, sample):
    text = tokenizer.decode(sample.input_ids)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoding["input_ids"] == sample.input_ids  # the sample is exactly the tokenized rendered text
    return text, encoding["offset_mapping"]


def _mask_from_strings(text, offsets, strings, minus=()):
    """Tokens overlapping the given strings (found in order), minus tokens overlapping ``minus``."""
    def char_spans(parts):
        spans, at = [], 0
        for part in parts:
            at = text.index(part, at)
            spans.append((at, at + len(part)))
            at += len(part)
        return spans

    def overlaps(spans, a, b):
        return any(a < e and max(b, a + 1) > s for s, e in spans)

    keep, drop = char_spans(strings), char_spans(minus)
    return [int(overlaps(keep, a, b) and not overlaps(drop, a, b)) for a, b in offsets]


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_supervised_tokens_per_family(tokenizers, family):
    tokenizer = tokenizers[family]
    prepared = _prepare(tokenizer)
    assert prepared.rendered_per_turn == (family == "qwen3")
    assert len(prepared.samples) == len(EXPECTED[family])
    for sample, strings in zip(prepared.samples, EXPECTED[family]):
        text, offsets = _text_and_offsets(tokenizer, sample)
        assert sample.loss_mask == _mask_from_strings(text, offsets, strings)
        assert sample.token_counts["supervised.end_of_turn"] == len(strings) == sample.num_turns
        assert sample.token_counts.get("supervised.outside_assistant", 0) == 0
        assert (sample.token_counts.get("supervised.tool_call", 0) > 0) == any("search_docs" in s for s in strings)


def test_token_kinds_of_a_reasoning_and_tool_turn(tokenizers):
    """Qwen3's tool-call turn, counted by hand from the literal text (a token of a region overlaps it)."""
    tokenizer = tokenizers["qwen3"]
    sample = _prepare(tokenizer).samples[0]
    text, offsets = _text_and_offsets(tokenizer, sample)
    reasoning_at = text.index(REASONING[0])
    call_at = text.rindex("<tool_call>\n{")  # the system prompt shows the format first
    call_end = text.index("</tool_call>", call_at) + len("</tool_call>")
    tokens = [(a, b) for (a, b), m in zip(offsets, sample.loss_mask) if m]
    expected = {
        "supervised.reasoning": sum(a < reasoning_at + len(REASONING[0]) and b > reasoning_at for a, b in tokens),
        "supervised.tool_call": sum(a < call_end and b > call_at for a, b in tokens),
        "supervised.end_of_turn": 1,
    }
    expected["supervised.content"] = len(tokens) - sum(expected.values())  # <think> delimiters and newlines
    assert {k: v for k, v in sample.token_counts.items() if k.startswith("supervised.")} == expected
    unsupervised = {k.split(".")[1] for k, v in sample.token_counts.items() if k.startswith("unsupervised.") and v}
    assert unsupervised == {"system", "user", "assistant"}  # the assistant's header; no tool reply yet


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_is_what_the_template_tokenizes_with_one_bos(tokenizers, family):
    """The rendered text is encoded without the tokenizer's own specials (its BOS is in the text)."""
    tokenizer = tokenizers[family]
    [first, *_] = _prepare(tokenizer).samples
    upto = 3 if family == "qwen3" else len(CONVERSATION["messages"])
    assert first.input_ids == tokenizer.apply_chat_template(CONVERSATION["messages"][:upto], tools=TOOLS,
                                                            tokenize=True, return_dict=False)
    if tokenizer.bos_token is not None:
        assert first.input_ids[0] == tokenizer.bos_token_id and first.input_ids[1] != tokenizer.bos_token_id


def test_qwen3_per_turn_samples_are_the_inference_time_text(tokenizers):
    """Each per-turn sample starts with exactly the prompt vLLM would render for that turn."""
    tokenizer = tokenizers["qwen3"]
    messages = CONVERSATION["messages"]
    for sample, turn in zip(_prepare(tokenizer).samples, (2, 4, 6)):
        prompt = tokenizer.apply_chat_template(messages[:turn], tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
        assert sample.input_ids[:len(prompt)] == prompt
        assert not any(sample.loss_mask[:len(prompt)]) and sample.loss_mask[len(prompt)]


@pytest.mark.parametrize("loss_on", ["last", "per_turn"])
def test_other_loss_modes_select_turns(tokenizers, loss_on):
    tokenizer = tokenizers["llama3"]
    samples = _prepare(tokenizer, loss_on=loss_on).samples
    expected = EXPECTED["llama3"][0]
    wanted = [expected[-1:]] if loss_on == "last" else [[s] for s in expected]
    assert len(samples) == len(wanted)
    for sample, strings in zip(samples, wanted):
        text, offsets = _text_and_offsets(tokenizer, sample)
        assert sample.loss_mask == _mask_from_strings(text, offsets, strings)  # earlier turns are context


def test_reasoning_can_be_left_out_of_the_loss(tokenizers):
    tokenizer = tokenizers["qwen3"]
    off = _prepare(tokenizer, supervise_reasoning=False)
    for sample, strings, reasoning in zip(off.samples, EXPECTED["qwen3"], REASONING):
        text, offsets = _text_and_offsets(tokenizer, sample)
        assert sample.loss_mask == _mask_from_strings(text, offsets, strings, minus=[reasoning])
        assert "supervised.reasoning" not in sample.token_counts
        assert tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m]).startswith("<think>")
    on = _prepare(tokenizer)
    assert all(s.token_counts["supervised.reasoning"] > 0 for s in on.samples)


def test_inline_think_blocks_count_as_reasoning(tokenizers):
    """Regenerated or exported data often carries the reasoning inside the content."""
    tokenizer = tokenizers["qwen3"]
    raw = {"messages": [{"role": "user", "content": "Why?"},
                        {"role": "assistant", "content": "<think>\nBecause it is.\n</think>\n\nIt just is."}]}
    [sample] = _prepare(tokenizer, raw).samples
    text, offsets = _text_and_offsets(tokenizer, sample)
    assert sample.loss_mask == _mask_from_strings(text, offsets,
                                                  ["<think>\nBecause it is.\n</think>\n\nIt just is.<|im_end|>"])
    [without] = _prepare(tokenizer, raw, supervise_reasoning=False).samples
    assert without.loss_mask == _mask_from_strings(text, offsets, ["<think>\nBecause it is.\n</think>\n\nIt just is."
                                                                   "<|im_end|>"], minus=["Because it is."])


def test_a_record_holding_the_mask_token_is_skipped(tokenizers):
    tokenizer = tokenizers["llama3"]
    raw = {"messages": [{"role": "user", "content": "Say <|reserved_special_token_247|>."},
                        {"role": "assistant", "content": "No."}]}
    prepared = prepare_record(SourceRecord(Path("c.jsonl"), 0, raw), tokenizer, max_seq_len=512, mask_token_id=128255)
    assert prepared.skip_reason == "contains_mask_token" and not prepared.samples
    assert _prepare(tokenizer, raw).samples  # another mask token: the record is fine
