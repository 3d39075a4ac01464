"""The mask token is chosen from the target alone, in the documented order, on tokenizers shaped like
the real families (none of which has a mask token), and a bad explicit choice is one clear line."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.stages.extract.mask_token import choose_mask_token, template_token_ids

EXPECTED = {
    "llama3": (128255, "<|reserved_special_token_247|>", S.MASK_FROM_RESERVED),
    "qwen3": (151669, None, S.MASK_FROM_UNUSED_ROW),  # first row past the tokenizer's 151,669 entries
    "mistral": (770, "[control_768]", S.MASK_FROM_RESERVED),
    # 17 specials, none reserved, no spare row: the highest one the ChatML template never writes
    "smollm2": (16, "<empty_output>", S.MASK_FROM_UNUSED_SPECIAL),
}


def _load(path):
    return AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_automatic_choice_per_family(family_target, family):
    tokenizer, vocab_size = _load(family_target(family))
    choice = choose_mask_token(tokenizer, vocab_size)
    assert (choice.token_id, choice.token, choice.source) == EXPECTED[family]
    assert choice.token_id not in template_token_ids(tokenizer)
    # a pure function of the tokenizer and the config: another load (another worker) agrees
    assert choose_mask_token(*_load(family_target(family))) == choice


def test_the_tokenizers_own_mask_token_comes_first(tiny_llama):
    tokenizer, vocab_size = _load(tiny_llama)
    choice = choose_mask_token(tokenizer, vocab_size)
    assert (choice.token, choice.source) == ("<|mask|>", S.MASK_FROM_TOKENIZER)


def test_explicit_choice_is_checked(family_target):
    tokenizer, vocab_size = _load(family_target("llama3"))
    choice = choose_mask_token(tokenizer, vocab_size, explicit=128100)
    assert (choice.token_id, choice.token, choice.source) == (128100, "<|reserved_special_token_92|>", S.MASK_FROM_FLAG)
    with pytest.raises(UserError, match=r"--mask-token-id 128256 is outside the target's embedding \(ids 0..128255\)"):
        choose_mask_token(tokenizer, vocab_size, explicit=128256)
    with pytest.raises(UserError, match=r"--mask-token-id 128009 is '<\|eot_id\|>', which the chat template writes"):
        choose_mask_token(tokenizer, vocab_size, explicit=128009)


def test_unnamed_unused_specials_come_after_reserved_names(family_target):
    """Mistral's layout with its [control_N] tokens renamed to names that say nothing: no mask token,
    no spare row, nothing reserved by name; the highest special the template never writes is taken."""
    tokenizer, vocab_size = _load(family_target("mistral"))
    reserved_free = _without_control_tokens(tokenizer)
    choice = choose_mask_token(reserved_free, vocab_size)
    assert (choice.token_id, choice.token, choice.source) == (770, "[slot770]", S.MASK_FROM_UNUSED_SPECIAL)


def test_gpt2_style_single_special_token_names_candidates(family_target):
    """GPT-2's one special token is BOS, EOS and UNK at once: nothing is safe to take, so the error
    lists regular ids a user could pass, each a real token of the tokenizer."""
    tokenizer, vocab_size = _load(family_target("gpt2"))
    with pytest.raises(UserError) as err:
        choose_mask_token(tokenizer, vocab_size)
    message = str(err.value)
    assert "\n" not in message and "--mask-token-id" in message and "candidates: " in message
    for tried in ("no usable mask token", "no row past the tokenizer's highest id 50256", "no reserved special token"):
        assert tried in message
    assert "every added special token is written by the chat template or is BOS/EOS/PAD/UNK" in message
    candidates = [int(part.split()[0]) for part in message.split("candidates: ")[1].split(" (")[0].split(", ")]
    assert len(candidates) == 5 and all(0 <= c < 50256 for c in candidates)
    # the listed ids are accepted as an explicit choice
    assert choose_mask_token(tokenizer, vocab_size, explicit=candidates[0]).source == S.MASK_FROM_FLAG


def test_tokens_the_template_may_write_are_never_chosen(family_target):
    """SmolLM2's layout with a template that also writes <empty_output> (as a tool-result marker):
    the next-highest unused special is chosen instead; a tool-calling probe finds template tokens
    that a plain conversation never shows."""
    tokenizer, vocab_size = _load(family_target("smollm2"))
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{%- endfor %}", "{%- if message.role == 'tool' %}{{- '<empty_output>' }}{%- endif %}{%- endfor %}")
    assert 16 in template_token_ids(tokenizer)  # the probe conversation with a tool result shows it
    choice = choose_mask_token(tokenizer, vocab_size)
    assert (choice.token_id, choice.token) == (15, "<jupyter_script>")


def _without_control_tokens(tokenizer):
    """The same tokenizer with its [control_N] tokens renamed to plain pieces (not reserved names)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    renamed = {t["content"]: f"[slot{i}]" for i, t in enumerate(data["added_tokens"]) if "control" in t["content"]}
    for t in data["added_tokens"]:
        t["content"] = renamed.get(t["content"], t["content"])
    data["model"]["vocab"] = {renamed.get(k, k): v for k, v in data["model"]["vocab"].items()}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.chat_template = tokenizer.chat_template
    return fast

