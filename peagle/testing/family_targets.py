"""Random-weight targets whose tokenizers and chat templates are shaped like released model families.

Nothing can be downloaded, so these are built locally, but with what a real target brings along and
the project's own tiny targets do not: the families' vocabulary sizes and special-token ids, no
``<|mask|>`` token, a post-processor that adds BOS, templates with the families' logic
(``chat_templates``), and an embedding with more rows than the tokenizer has entries (Qwen3):

* ``llama3``: byte-level BPE with the Llama-3 split pattern, 128,000 regular tokens, then the 256
  specials at their Llama-3.1 ids (``<|begin_of_text|>`` 128000, ``<|eot_id|>`` 128009,
  ``<|reserved_special_token_N|>`` ...); vocab_size 128,256; llama3 RoPE scaling.
* ``qwen3``: byte-level BPE with Qwen's pattern, 151,643 regular tokens, specials 151,643-151,668
  (``<think>``, ``<tool_call>`` ... are added but not special, as in Qwen3); a tokenizer of 151,669
  entries in an embedding of 151,936 rows; Qwen3ForCausalLM (explicit head_dim, q/k norms).
* ``mistral``: SentencePiece-style BPE (``▁`` word marker, byte fallback) of 32,768 entries:
  ``<unk>`` ``<s>`` ``</s>``, the instruction and tool markers, ``[control_N]`` up to id 770, the
  256 byte tokens, then pieces; the tokenizer adds ``<s>`` and the template writes it too.
* ``smollm2``: byte-level BPE of 49,152 entries whose first 17 are its specials (``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``, then 14 code-corpus markers such as ``<filename>``,
  ``<jupyter_code>``, ``<empty_output>``); no reserved tokens, no spare embedding row; a ChatML
  template that adds a default system turn; tied embeddings.
* ``gpt2``: byte-level BPE of 50,257 entries with one special token, ``<|endoftext|>`` (50256), which
  is BOS, EOS and UNK at once; a plain-text chat template (``User: ...``). Its config is a Llama one:
  only the tokenizer's shape matters here (models fine-tuned on GPT-2's tokenizer).

A corpus that ships with Python gives a few thousand real merges; the rest of each vocabulary is
filled with real-looking word pieces (a trained word start plus a trained suffix, each reachable by
one more merge), so every id up to the family's size is a real, encodable token. Weights are tiny
(hidden 64, head_dim 32 for vLLM's CPU attention, 8 layers) and random; embeddings have the real
row counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from peagle.demo.tiny_target import tokenizer_corpus
from peagle.pipeline.atomic import atomic_dir
from peagle.testing.chat_templates import (GPT2_CHAT_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, QWEN3_TEMPLATE,
                                           SMOLLM2_TEMPLATE)

FAMILIES = ("llama3", "qwen3", "mistral", "smollm2", "gpt2")

# Pre-tokenizer split patterns of the byte-level families (Llama-3 groups up to 3 digits, Qwen 1).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _llama3_specials() -> list[tuple[str, bool]]:
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
             10: "<|python_tag|>"}
    out, reserved = [], 0
    for offset in range(256):
        if offset in named:
            out.append((named[offset], True))
        else:
            out.append((f"<|reserved_special_token_{reserved}|>", True))
            reserved += 1
    return out


QWEN3_SPECIALS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

MISTRAL_SPECIALS = [("<unk>", True), ("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True),
                    ("[TOOL_CALLS]", True), ("[AVAILABLE_TOOLS]", True), ("[/AVAILABLE_TOOLS]", True),
                    ("[TOOL_RESULTS]", True), ("[/TOOL_RESULTS]", True)] + [
                    (f"[control_{i}]", True) for i in range(8, 769)]

SMOLLM2_SPECIALS = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
    "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
    "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>")]


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """One family's tokenizer layout, special tokens and config."""

    name: str
    architecture: str  # transformers config class name prefix: Llama, Qwen3, Mistral
    tokenizer_size: int  # entries of the tokenizer (regular + specials)
    vocab_size: int  # rows of the embedding (config.vocab_size)
    specials: list[tuple[str, bool]]  # (content, special) in id order
    first_special_id: int  # byte-level families: specials follow the regular tokens
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    template: str
    rope: dict = field(default_factory=dict)
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[str, ...] = ()  # the config's eos ids (a family may stop on several)
    tie_word_embeddings: bool = False
    adds_bos: bool = True  # the tokenizer's post-processor adds BOS (the double-BOS trap of templates that write it)


SPECS = {
    "llama3": FamilySpec(
        name="llama3", architecture="Llama", tokenizer_size=128256, vocab_size=128256, specials=_llama3_specials(),
        first_special_id=128000, bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None,
        template=LLAMA3_TEMPLATE, max_position_embeddings=131072,
        rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        eos_token_ids=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "qwen3": FamilySpec(
        name="qwen3", architecture="Qwen3", tokenizer_size=151669, vocab_size=151936, specials=QWEN3_SPECIALS,
        first_special_id=151643, bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        template=QWEN3_TEMPLATE, max_position_embeddings=40960,
        rope={"rope_type": "default", "rope_theta": 1000000.0}, eos_token_ids=("<|im_end|>", "<|endoftext|>")),
    "mistral": FamilySpec(
        name="mistral", architecture="Mistral", tokenizer_size=32768, vocab_size=32768, specials=MISTRAL_SPECIALS,
        first_special_id=0, bos="<s>", eos="</s>", pad=None, unk="<unk>", template=MISTRAL_TEMPLATE,
        max_position_embeddings=32768, rope={"rope_type": "default", "rope_theta": 1000000.0},
        eos_token_ids=("</s>",)),
    "smollm2": FamilySpec(
        name="smollm2", architecture="Llama", tokenizer_size=49152, vocab_size=49152, specials=SMOLLM2_SPECIALS,
        first_special_id=0, bos="<|im_start|>", eos="<|im_end|>", pad="<|im_end|>", unk="<|endoftext|>",
        template=SMOLLM2_TEMPLATE, max_position_embeddings=8192, rope={"rope_type": "default", "rope_theta": 100000.0},
        eos_token_ids=("<|im_end|>",), tie_word_embeddings=True, adds_bos=False),
    "gpt2": FamilySpec(
        name="gpt2", architecture="Llama", tokenizer_size=50257, vocab_size=50257, specials=[("<|endoftext|>", True)],
        first_special_id=50256, bos="<|endoftext|>", eos="<|endoftext|>", pad=None, unk="<|endoftext|>",
        template=GPT2_CHAT_TEMPLATE, max_position_embeddings=1024, rope={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_ids=("<|endoftext|>",), adds_bos=False),
}


def _filler_pieces(tokens: list[str], marker: str, count: int) -> list[tuple[str, str]]:
    """``count`` new merges ``(start, suffix)``: a trained word start followed by a trained suffix,
    in a fixed order, each making a token that does not exist yet."""
    starts = [t for t in tokens if t.startswith(marker) and t[len(marker):].isalpha() and len(t) >= len(marker) + 2]
    suffixes = [t for t in tokens if t.isalpha() and t.islower() and 2 <= len(t) <= 4]
    seen, out = set(tokens), []
    for suffix in suffixes:
        for start in starts:
            piece = start + suffix
            if piece not in seen:
                seen.add(piece)
                out.append((start, suffix))
                if len(out) == count:
                    return out
    raise AssertionError(f"the corpus gives only {len(out)} filler pieces, {count} needed")


def _trained_bpe(pre_tokenizer, normalizer=None, alphabet=None) -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens in id order, merges in rank order) of a BPE trained on the stdlib corpus."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=60000, initial_alphabet=alphabet or [], show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, merges


def build_family_tokenizer(family: str):
    """The family's tokenizer as a transformers fast tokenizer with its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = SPECS[family]
    if family == "mistral":
        meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
        tokens, merges = _trained_bpe(meta)
        head = [content for content, _ in spec.specials] + [f"<0x{b:02X}>" for b in range(256)]
        vocab_tokens = head + [t for t in tokens if t not in head]
        fillers = _filler_pieces(vocab_tokens, "▁", spec.tokenizer_size - len(vocab_tokens))
        vocab_tokens += [a + b for a, b in fillers]
        merges = merges + fillers
        model = models.BPE(vocab={t: i for i, t in enumerate(vocab_tokens)}, merges=merges, unk_token="<unk>",
                           byte_fallback=True, fuse_unk=True)
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        split = pre_tokenizers.Split(Regex(QWEN_SPLIT if family in ("qwen3", "smollm2") else LLAMA3_SPLIT), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        pre = pre_tokenizers.Sequence([split, byte_level])
        tokens, merges = _trained_bpe(pre, alphabet=pre_tokenizers.ByteLevel.alphabet())
        head = [content for content, _ in spec.specials] if spec.first_special_id == 0 else []
        num_regular = spec.tokenizer_size - len(spec.specials)
        fillers = _filler_pieces(tokens, "Ġ", num_regular - len(tokens))
        vocab_tokens = head + tokens + [a + b for a, b in fillers]
        model = models.BPE(vocab={t: i for i, t in enumerate(vocab_tokens)}, merges=merges + fillers,
                           ignore_merges=family == "llama3")
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        if family == "qwen3":
            from tokenizers import normalizers

            tok.normalizer = normalizers.NFC()
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(content, special=special, normalized=False) for content, special in spec.specials])
    for i, (content, _) in enumerate(spec.specials):  # the family's ids, not wherever add_tokens put them
        assert tok.token_to_id(content) == spec.first_special_id + i, (family, content)
    if spec.bos is not None and spec.adds_bos:  # the tokenizer adds BOS itself: the double-BOS trap of templates that write it
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, tok.token_to_id(spec.bos))])
    assert tok.get_vocab_size() == spec.tokenizer_size, (family, tok.get_vocab_size())
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad,
                                   unk_token=spec.unk)
    fast.chat_template = spec.template
    return fast


def build_family_config(family: str, tokenizer, *, hidden_size: int = 64, num_layers: int = 8):
    """The family's config class at tiny size: two query heads of 32 sharing one KV head (grouped
    query attention, as the families use; head_dim 32 for vLLM's CPU attention)."""
    import transformers

    spec = SPECS[family]
    config_class = getattr(transformers, f"{spec.architecture}Config")
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.eos_token_ids]
    return config_class(
        vocab_size=spec.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 32, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters=dict(spec.rope), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids, pad_token_id=tokenizer.pad_token_id,
    )


def build_family_target(out_dir: str | Path, family: str, *, seed: int = 0) -> Path:
    """Build the family's random-weight target (model + tokenizer + template) into ``out_dir``.

    Written atomically (``atomic_dir``: a temp dir, then one rename); an existing target is returned as
    it is.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if family not in SPECS:
        raise ValueError(f"unknown family {family!r} (expected one of {', '.join(FAMILIES)})")
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    with atomic_dir(out_dir) as tmp:
        tokenizer = build_family_tokenizer(family)
        config = build_family_config(family, tokenizer)
        config.architectures = [f"{SPECS[family].architecture}ForCausalLM"]
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir
