"""`peagle prompts` (Magpie): the user-turn prefix of every template family, the filters on given strings,
the sampling loop on a scripted backend (dedup, exclusions, counted drops, determinism, the cap), and the
real command on the tiny target with the hf backend (records extract accepts, same seed same bytes,
held-out prompts and phrases kept out, one-line errors).

The tiny targets write gibberish that ends its turn only by chance, so their runs relax the filters
(``--min-words 1 --no-request-filter``) and check what must hold whatever the text: counts, format,
determinism and exclusions.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from peagle.model.target.directory import open_target
from peagle.schemas.errors import UserError
from peagle.schemas.prompts_config import PromptsConfig
from peagle.stages.extract import prompts as M
from peagle.stages.extract.conversation import normalise_record
from peagle.stages.extract.regenerate import SamplingSettings, derived_seed
from peagle.testing.family_targets import FAMILIES, build_family_tokenizer

USER_TEXT = "Hello there, how are you?"
END_TOKEN = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "mistral": "[/INST]", "smollm2": "<|im_end|>",
             "gpt2": None}
"""The token that ends a user turn in each family's template (gpt2's chat template ends it with text)."""


@pytest.fixture(scope="module")
def family_tokenizers():
    return {family: build_family_tokenizer(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return open_target(tiny_llama).tokenizer


# ------------------------------------------------------------------------------------------------------
# The prefix


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prefix_ends_where_the_users_text_starts(family, family_tokenizers):
    tok = family_tokenizers[family]
    prefix = M.magpie_prefix(tok, eos_token_ids=[tok.eos_token_id])
    rendered = tok.apply_chat_template([{"role": "user", "content": USER_TEXT}], tokenize=False)
    assert rendered.startswith(prefix.text), (prefix.text, rendered)
    assert rendered[len(prefix.text):].lstrip(" ").startswith(USER_TEXT)  # only the spaces before it are cut
    assert M.PLACEHOLDER not in prefix.text and "Hello" not in prefix.text
    assert list(prefix.token_ids) == tok(prefix.text, add_special_tokens=False)["input_ids"]
    assert prefix.token_ids[:2] != (tok.bos_token_id,) * 2  # a template that writes BOS: once, not twice
    end = END_TOKEN[family]
    if end is None:
        assert prefix.end_text == "\n\n" and prefix.stop_token_ids == (tok.eos_token_id,)
    else:
        assert prefix.end_text is None and prefix.stop_token_ids[0] == tok.convert_tokens_to_ids(end)
        assert tok.eos_token_id in prefix.stop_token_ids


def test_the_prefix_keeps_what_the_template_writes_before_a_first_user_turn(family_tokenizers):
    smollm2 = M.magpie_prefix(family_tokenizers["smollm2"]).text
    assert smollm2 == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                       "<|im_end|>\n<|im_start|>user\n")
    assert M.magpie_prefix(family_tokenizers["qwen3"]).text == "<|im_start|>user\n"
    assert M.magpie_prefix(family_tokenizers["mistral"]).text == "<s>[INST]"
    llama3 = M.magpie_prefix(family_tokenizers["llama3"]).text
    assert llama3.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge")
    assert llama3.endswith("<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")


def test_the_tiny_targets_prefixes(tiny_llama, tiny_qwen3):
    llama = M.magpie_prefix(open_target(tiny_llama).tokenizer)
    qwen = M.magpie_prefix(open_target(tiny_qwen3).tokenizer)
    assert llama.text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    assert qwen.text == "<|im_start|>user\n"


@pytest.mark.parametrize("template,message", [
    (None, "has no chat template"),
    ("{{ 'a fixed text' }}", "does not render a user message's text as given"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "writes nothing before a user's text"),
    ("{{ raise_exception('only assistants here') }}", "cannot render one user message: .*only assistants here"),
])
def test_a_template_without_a_usable_user_turn_is_one_line(template, message, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = template
    with pytest.raises(UserError, match=message):
        M.magpie_prefix(tok)


# ------------------------------------------------------------------------------------------------------
# The filters, on given strings

PHRASES = M.phrase_pattern(["Eiffel Tower", "Acme-9"])
FILTERS = M.PromptFilters(min_words=3, max_words=12, excluded_phrases=PHRASES,
                          excluded_prompts=frozenset({M.prompt_key("How do I bake bread?")}))


@pytest.mark.parametrize("text,ended,reason", [
    ("What is the capital of France?", True, None),
    ("Write a haiku about autumn leaves.", True, None),
    ("I'm stuck on my calculus homework, any tips", True, None),
    ("What is the capital of France?", False, M.TRUNCATED),
    ("   ", True, M.EMPTY),
    ("Why not?", True, M.TOO_SHORT),
    ("Can you " + "please " * 12 + "help?", True, M.TOO_LONG),
    ("The weather was lovely on Sunday.", True, M.NOT_A_REQUEST),
    ("How tall is the eiffel   tower?", True, M.EXCLUDED_PHRASE),
    ("Tell me about the ACME-9 rocket.", True, M.EXCLUDED_PHRASE),
    ("Is Parisian food as good as the Eiffel Towers look?", True, None),  # whole words only
    ("how do i bake BREAD", True, M.EXCLUDED_PROMPT),
    ("  WHAT is the capital of france!! ", True, M.DUPLICATE),
])
def test_drop_reason(text, ended, reason):
    seen = {M.prompt_key("What is the capital of France?")} if reason == M.DUPLICATE else set()
    assert M.drop_reason(text, ended=ended, filters=FILTERS, seen=seen) == reason


def test_the_request_heuristic_and_word_counts():
    assert M.looks_like_request("Explain quantum tunnelling to a child.")
    assert M.looks_like_request('"Hey, could you look at this code"')
    assert M.looks_like_request("¿Qué hora es?") and M.looks_like_request("今天天气怎么样？")
    assert not M.looks_like_request("A list of ten fruits.") and not M.looks_like_request("")
    assert not M.drop_reason("Sunday was lovely.", ended=True, seen=set(),
                             filters=M.PromptFilters(request_filter=False))
    assert M.count_words("今天天气怎么样") == 7 and M.count_words("It's 3 o'clock, isn't it?") == 8
    assert M.prompt_key("  What's   UP?! ") == M.prompt_key("what s up") == "what s up"
    assert M.phrase_pattern(["", "  "]) is None


def test_completion_text_cuts_at_the_end_of_the_turn(tokenizer, family_tokenizers):
    prefix = M.magpie_prefix(tokenizer)
    eot = prefix.stop_token_ids[0]
    ids = tokenizer("What is it?", add_special_tokens=False)["input_ids"]
    answer = tokenizer("An answer the target went on to write.", add_special_tokens=False)["input_ids"]
    assert M.completion_text(ids + [eot] + answer, tokenizer, prefix, 64) == ("What is it?", True)
    assert M.completion_text(ids, tokenizer, prefix, len(ids)) == ("What is it?", False)  # hit the limit
    assert M.completion_text(ids, tokenizer, prefix, len(ids) + 1) == ("What is it?", True)  # the backend stopped
    gpt2 = family_tokenizers["gpt2"]
    text_ids = gpt2(" What is it?\n\nAssistant: It is", add_special_tokens=False)["input_ids"]
    assert M.completion_text(text_ids, gpt2, M.magpie_prefix(gpt2), len(text_ids)) == ("What is it?", True)


# ------------------------------------------------------------------------------------------------------
# The sampling loop, on a scripted backend

TEXTS = [
    "What is the capital of France?", "what is the capital of FRANCE", "Write a poem about the sea.",
    "How do I sort a list in Python?", "Can you explain photosynthesis simply?", "How tall is the Eiffel Tower?",
    "How do I bake bread?", "The sea is blue today.", "Hi?", "Please summarise the French revolution.",
    "Why is the sky blue?", "Could you recommend a good book?", "Tell me a joke about cats.",
    *["Describe the water cycle in detail " + "and more " * 30] * 2,  # longer than max_new_tokens
]


class ScriptedBackend:
    """Picks texts with the call's seed and ends each with the end-of-turn token and an answer after it
    (as vLLM does when the end of turn is no EOS); it takes no stop ids, as vLLM's generate."""

    name = "scripted"

    def __init__(self, tokenizer, texts=TEXTS) -> None:
        self.tokenizer, self.texts, self.calls = tokenizer, texts, []
        self.eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")

    def generate(self, prompts_token_ids, *, max_new_tokens, temperature, top_p, seed):
        self.calls.append((prompts_token_ids, seed))
        rng = random.Random(seed)
        out = []
        for _ in prompts_token_ids:
            ids = self.tokenizer(" " + rng.choice(self.texts), add_special_tokens=False)["input_ids"]
            out.append((ids + [self.eot] + ids)[:max_new_tokens])
        return out

    def close(self) -> None:
        pass


def _sample(tokenizer, backend, *, seed=0, num_prompts=8, filters=FILTERS, factor=10.0):
    sampling = SamplingSettings(max_new_tokens=40, temperature=1.0, top_p=1.0, seed=seed)
    return M.sample_prompts(backend, tokenizer, M.magpie_prefix(tokenizer), filters, num_prompts=num_prompts,
                            batch_size=8, sampling=sampling, max_samples_factor=factor)


def test_sampling_keeps_distinct_filtered_prompts_and_counts_every_drop(tokenizer):
    backend = ScriptedBackend(tokenizer)
    summary = _sample(tokenizer, backend)  # 8 prompts: every distinct one of TEXTS that passes
    assert summary.num_kept == 8 and len({M.prompt_key(p) for p in summary.prompts}) == 8
    assert summary.num_sampled == 8 + sum(summary.dropped.values())
    assert set(summary.dropped) == {M.TRUNCATED, M.TOO_SHORT, M.NOT_A_REQUEST, M.EXCLUDED_PHRASE, M.EXCLUDED_PROMPT,
                                    M.DUPLICATE}, summary.dropped
    assert all(p in TEXTS for p in summary.prompts)  # cut at the end of the turn, nothing of the answer
    assert not any("eiffel" in p.lower() or "bake bread" in p for p in summary.prompts)
    prefix = M.magpie_prefix(tokenizer)
    assert [seed for _, seed in backend.calls] == [derived_seed(0, r) for r in range(len(backend.calls))]
    assert all(prompts == [list(prefix.token_ids)] * 8 for prompts, _ in backend.calls)


def test_sampling_is_a_function_of_the_seed(tokenizer):
    first = _sample(tokenizer, ScriptedBackend(tokenizer)).prompts
    assert _sample(tokenizer, ScriptedBackend(tokenizer)).prompts == first
    assert _sample(tokenizer, ScriptedBackend(tokenizer), seed=1).prompts != first


def test_a_target_that_repeats_itself_ends_in_one_line_after_the_cap(tokenizer):
    backend = ScriptedBackend(tokenizer, texts=["What is the capital of France?"])
    with pytest.raises(UserError, match=r"only 1 of 5 prompts were kept after 40 samples \(5 rounds, "
                                        r"--max-samples-factor 8\); dropped: duplicate 39\. Nothing was written"):
        _sample(tokenizer, backend, num_prompts=5, factor=8)
    assert len(backend.calls) == 5


# ------------------------------------------------------------------------------------------------------
# The real thing: the tiny target through the hf backend

RELAXED = dict(num_prompts=3, batch_size=16, max_new_tokens=48, min_words=1, request_filter=False,
               max_samples_factor=100, backend="hf", device="cpu", threads=1)


def _run(target: Path, out: Path, **kw) -> M.PromptsSummary:
    lines: list[str] = []
    summary = M.run_prompts(PromptsConfig(target=str(target), out=str(out), **{**RELAXED, **kw}), echo=lines.append)
    summary.lines = lines  # type: ignore[attr-defined]
    return summary


@pytest.fixture(scope="module")
def first_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "sub" / "prompts.jsonl"
    return out, _run(tiny_llama, out)


def test_writes_prompt_only_records_that_extract_accepts(first_run):
    out, summary = first_run
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["messages"][0]["content"] for r in records] == summary.prompts and len(records) == 3
    for raw in records:
        assert list(raw) == ["messages"] and len(raw["messages"]) == 1 and raw["messages"][0]["role"] == "user"
        conversation = normalise_record(raw, to_regenerate=True)
        assert conversation.messages[0] == raw["messages"][0] and conversation.trainable_turns == [1]
    assert summary.num_sampled == 3 + sum(summary.dropped.values()) and summary.num_tokens > 0
    assert summary.lines[0].startswith("prompts: round 1: ") and "tokens/s" in summary.lines[0]
    assert summary.lines[-1].startswith(f"wrote 3 prompts to {out}: {summary.num_sampled} sampled, dropped ")
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temp file left beside it


def test_the_same_seed_writes_the_same_file_and_another_seed_another(first_run, tiny_llama, tmp_path):
    out, _ = first_run
    _run(tiny_llama, tmp_path / "again.jsonl")
    _run(tiny_llama, tmp_path / "other.jsonl", seed=1)
    assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()
    assert (tmp_path / "other.jsonl").read_bytes() != out.read_bytes()


def test_held_out_prompts_and_phrases_stay_out(first_run, tiny_llama, tmp_path):
    out, first = first_run
    held_out = tmp_path / "heldout.jsonl"  # an eval set: complete chats, one of them in ShareGPT form
    held_out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p.upper() + " "},
                                                         {"role": "assistant", "content": "An answer."}]}) + "\n"
                                for p in first.prompts[:2])
                        + json.dumps({"conversations": [{"from": "human", "value": first.prompts[2]}]}) + "\n"
                        + "{not json\n")
    again = _run(tiny_llama, tmp_path / "a.jsonl", exclude_prompts=str(held_out))
    assert again.dropped[M.EXCLUDED_PROMPT] == 3 and not set(again.prompts) & set(first.prompts)

    word = max(re.findall(r"\w+", " ".join(first.prompts)), key=len)
    (tmp_path / "phrases.txt").write_text(f"\n{word}\n")
    pattern = M.phrase_pattern([word])
    again = _run(tiny_llama, tmp_path / "b.jsonl", exclude_phrases=str(tmp_path / "phrases.txt"))
    assert again.dropped[M.EXCLUDED_PHRASE] >= 1 and not any(pattern.search(p) for p in again.prompts)


def test_unreadable_filter_files_are_one_line_before_the_model_loads(tiny_llama, tmp_path):
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "assistant", "content": "no user"}]}\n')
    for kw, message in ((dict(exclude_phrases=str(tmp_path / "empty.txt")), "holds no phrase"),
                        (dict(exclude_phrases=str(tmp_path / "none.txt")), "cannot read --exclude-phrases"),
                        (dict(exclude_prompts=str(tmp_path / "chats.jsonl")), "has no chat record with a user"),
                        (dict(exclude_prompts=str(tmp_path / "none.jsonl")), "does not exist")):
        with pytest.raises(UserError, match=message):
            _run(tmp_path / "no-target", tmp_path / "out.jsonl", **kw)


@pytest.mark.parametrize("kw,message", [
    (dict(temperature=0.0), "--temperature must be > 0"),
    (dict(top_p=0.0), r"--top-p must be in \(0, 1\]"),
    (dict(num_prompts=0), "--num-prompts must be >= 1"),
    (dict(min_words=5, max_words=4), "--max-words 4 is below --min-words 5"),
    (dict(max_samples_factor=0.5), "--max-samples-factor must be >= 1"),
    (dict(threads=-1), "--threads must be >= 0"),
    (dict(backend="tgi"), "--backend must be one of auto|hf|vllm"),
    (dict(dtype="int8"), "--dtype must be one of"),
])
def test_bad_settings_are_refused_before_anything_runs(kw, message, tmp_path):
    with pytest.raises(UserError, match=message):
        PromptsConfig(target="t", out=str(tmp_path / "p.jsonl"), **kw)
    assert PromptsConfig(target="t", out=str(tmp_path / "p.jsonl"), dtype="bf16").dtype == "bfloat16"


# ------------------------------------------------------------------------------------------------------
# The command


def _one_line(proc, needle: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("peagle: error: ") and needle in proc.stderr, proc.stderr


def test_command_errors_are_one_line_with_exit_code_2(tmp_path, run_peagle):
    out = tmp_path / "p.jsonl"
    _one_line(run_peagle("prompts", "--target", tmp_path / "missing", "--out", out),
              f"target model directory {tmp_path / 'missing'} does not exist")
    _one_line(run_peagle("prompts", "--target", tmp_path, "--out", out, "--no-such-flag"), "--no-such-flag")
    _one_line(run_peagle("prompts", "--target", tmp_path, "--out", out, "--backend", "tgi"), "--backend")
    _one_line(run_peagle("prompts", "--target", tmp_path, "--out", out, "--temperature", "0"),
              "--temperature must be > 0")
    assert not out.exists()


@pytest.mark.slow
def test_command_writes_prompts_and_never_overwrites_them(tiny_llama, first_run, tmp_path, run_peagle):
    out = tmp_path / "prompts.jsonl"
    args = ["prompts", "--target", tiny_llama, "--out", out, "--num-prompts", "3", "--batch-size", "16",
            "--max-new-tokens", "48", "--min-words", "1", "--no-request-filter", "--max-samples-factor", "100",
            "--backend", "hf", "--device", "cpu", "--threads", "1"]
    proc = run_peagle(*args)
    assert proc.returncode == 0, proc.stderr
    assert "prompts: round 1: " in proc.stdout and f"wrote 3 prompts to {out}" in proc.stdout
    assert out.read_bytes() == first_run[0].read_bytes()  # same seed, backend and batch: same prompts
    before = out.read_bytes()
    _one_line(run_peagle(*args, "--seed", "1"), f"--out {out} exists; remove it or name another file")
    assert out.read_bytes() == before
