"""The family targets are shaped like the released models they stand for: sizes, special-token ids,
BOS handling and template behaviour are what a pipeline meets on a real Llama-3.1, Qwen3 or Mistral
directory (nothing here can download those, so these facts are written down from the families)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer

FAMILY_FACTS = {
    # family: (tokenizer entries, embedding rows, {token: id}, architecture)
    "llama3": (128256, 128256, {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
                                "<|reserved_special_token_0|>": 128002, "<|start_header_id|>": 128006,
                                "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009,
                                "<|python_tag|>": 128010, "<|reserved_special_token_247|>": 128255},
               "LlamaForCausalLM"),
    "qwen3": (151669, 151936, {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                               "<tool_call>": 151657, "</tool_call>": 151658, "<tool_response>": 151665,
                               "<think>": 151667, "</think>": 151668}, "Qwen3ForCausalLM"),
    "mistral": (32768, 32768, {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 5,
                               "[control_8]": 10, "[control_768]": 770, "<0x00>": 771}, "MistralForCausalLM"),
}


@pytest.mark.parametrize("family", sorted(FAMILY_FACTS))
def test_sizes_ids_and_architecture_are_the_familys(family_target, family):
    path = family_target(family)
    entries, rows, ids, architecture = FAMILY_FACTS[family]
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    assert len(tokenizer) == entries and config.vocab_size == rows
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in ids} == ids
    assert config.architectures == [architecture] and config.head_dim == 32 and config.num_hidden_layers == 8
    assert tokenizer.mask_token is None and "<|mask|>" not in tokenizer.get_vocab()
    # every id is a real token that round-trips (the vocab was filled with encodable pieces)
    assert sorted(tokenizer.get_vocab().values()) == list(range(entries))


@pytest.mark.parametrize("family", sorted(FAMILY_FACTS))
def test_filler_pieces_are_reachable(family_target, family):
    tokenizer = AutoTokenizer.from_pretrained(family_target(family))
    vocab = tokenizer.get_vocab()
    piece = max((t for t in vocab if t[1:].isalpha() and vocab[t] < 30000), key=vocab.get)  # a late regular piece
    text = tokenizer.convert_tokens_to_string([piece])
    assert tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"]) == [piece]


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_double_bos_trap_is_there(family_target, family):
    """The tokenizer adds BOS and the template writes it: encoding the rendered text the default way
    gives two, which is the mistake the pipeline must not make."""
    tokenizer = AutoTokenizer.from_pretrained(family_target(family))
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith(tokenizer.bos_token)
    assert tokenizer(text)["input_ids"][:2] == [tokenizer.bos_token_id] * 2
    assert tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[:2] != [tokenizer.bos_token_id] * 2


def test_llama3_template_injects_dates_tools_and_json_calls(family_target):
    tokenizer = AutoTokenizer.from_pretrained(family_target("llama3"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "done"}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024" in text
    assert text.index('"name": "f"') < text.index("Go.")  # the tool list goes into the first user message
    assert '<|end_header_id|>\n\n{"name": "f", "parameters": {"x": 1}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\ndone<|eot_id|>" in text


def test_qwen3_template_strips_earlier_reasoning_and_wraps_tool_replies(family_target):
    tokenizer = AutoTokenizer.from_pretrained(family_target("qwen3"))
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    upto_first = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<think>\nr1\n</think>\n\na1" in upto_first and "r1" not in whole  # history rewritten
    assert whole.endswith("<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n")
    tools = [{"role": "tool", "content": "x"}, {"role": "tool", "content": "y"}]
    text = tokenizer.apply_chat_template(messages[:1] + tools, tokenize=False)
    assert text.endswith("<|im_start|>user\n<tool_response>\nx\n</tool_response>\n<tool_response>\ny\n"
                         "</tool_response><|im_end|>\n")
    no_thinking = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True,
                                                enable_thinking=False)
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_targets_are_saved_whole_and_reused(family_target, tmp_path):
    from peagle.testing.family_targets import build_family_target

    path = family_target("mistral")
    assert build_family_target(path, "mistral") == path  # an existing target is returned as is
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 32768
    with pytest.raises(ValueError, match="unknown family"):
        build_family_target(tmp_path / "x", "gemma")
