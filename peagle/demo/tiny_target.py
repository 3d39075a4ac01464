"""Tiny target models built and saved locally: the test suite's and the demo's targets.

Nothing here touches a model hub. The tokenizer is a byte-level BPE trained with `tokenizers` on
text that ships with Python (stdlib docstrings), so every machine of one Python version builds the
same tokenizer. Two architectures exist so nothing in peagle is Llama-only:

* ``llama``: LlamaForCausalLM with a Llama-3-style chat template.
* ``qwen3``: Qwen3ForCausalLM (explicit head_dim, q/k norms) with a ChatML template.

Both templates render ``reasoning_content`` and ``tool_calls`` when a message has them, and neither
has generation markers (like real templates): extract finds assistant spans by rendering prefixes.
A ``<|mask|>`` token is the tokenizer's ``mask_token`` and never occurs in rendered chats, so
extract chooses it as the draft's mask token (real targets have none: ``family_targets``).

Head dim is 32 so that vLLM's CPU attention accepts the models; 8 layers so the default aux layers
``[2, N//2, N-3]`` are distinct and away from the ends.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from peagle.pipeline.atomic import atomic_dir

MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# Assistant turns render reasoning and tool calls when present; no {% generation %} markers.
_ASSISTANT_EXTRAS = (
    "{%- if message.reasoning_content is defined and message.reasoning_content %}"
    "<think>{{ message.reasoning_content }}</think>"
    "{%- endif %}"
    "{%- if message.content is string %}{{ message.content }}{%- endif %}"
    "{%- if message.tool_calls is defined and message.tool_calls %}"
    "{%- for call in message.tool_calls %}<tool_call>{{ call | tojson }}</tool_call>{%- endfor %}"
    "{%- endif %}"
)

LLAMA_CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.role == 'assistant' %}" + _ASSISTANT_EXTRAS + "{%- else %}"
    "{%- if message.content is string %}{{ message.content }}{%- endif %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}" + _ASSISTANT_EXTRAS + "{%- else %}"
    "{%- if message.content is string %}{{ message.content }}{%- endif %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True, kw_only=True)
class TinyTargetSpec:
    """Shape of a tiny target. Defaults: 8 layers, hidden 128, head_dim 32 (vLLM CPU supports it)."""

    arch: str = "llama"
    num_layers: int = 8
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    seed: int = 0


def tokenizer_corpus() -> list[str]:
    """Docstrings of stdlib modules: offline, deterministic for one Python version, real English.

    Submodules are left out: a package's attributes include every submodule anything in the process
    has imported (``email.mime``, ``logging.handlers``; vLLM imports several), so with them the corpus,
    and with it every test target's tokenizer, depended on which tests ran first."""
    import argparse, collections, csv, email, json as json_mod, logging, pathlib, textwrap, unittest  # noqa: E401

    texts: list[str] = []
    for module in (argparse, collections, csv, email, json_mod, logging, pathlib, textwrap, unittest):
        for _, obj in sorted(inspect.getmembers(module)):
            if inspect.ismodule(obj):
                continue
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    return texts


def build_tokenizer(vocab_size: int, arch: str, corpus: Sequence[str] | None = None):
    """Train a byte-level BPE and wrap it as a transformers fast tokenizer with a chat template.

    ``corpus`` defaults to :func:`tokenizer_corpus`; a target trained on other text (the quality
    benchmark's code and prose) passes its own, so its tokens fit what it writes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = (LLAMA_SPECIALS if arch == "llama" else QWEN_SPECIALS) + THINK_TOKENS + [MASK_TOKEN, PAD_TOKEN]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus() if corpus is None else corpus, trainer=trainer)
    if arch == "llama":
        bos, eos, template = "<|begin_of_text|>", "<|eot_id|>", LLAMA_CHAT_TEMPLATE
    else:
        bos, eos, template = None, "<|im_end|>", QWEN_CHAT_TEMPLATE
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=PAD_TOKEN, mask_token=MASK_TOKEN,
    )
    fast.chat_template = template
    return fast


def build_config(spec: TinyTargetSpec, tokenizer):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if spec.arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if spec.arch == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(f"unknown tiny target arch {spec.arch!r} (expected 'llama' or 'qwen3')")


def build_tiny_target(out_dir: str | Path, spec: TinyTargetSpec = TinyTargetSpec(), *,
                      tokenizer_texts: Sequence[str] | None = None) -> Path:
    """Build a random-weight tiny target (model + tokenizer) and save it to ``out_dir``.

    ``tokenizer_texts``: what the BPE tokenizer is trained on (default: :func:`tokenizer_corpus`).

    The write is atomic (``atomic_dir``: a temp dir, then one rename), so a cache dir never holds
    half a model. Returns the model directory.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    with atomic_dir(out_dir) as tmp:
        tokenizer = build_tokenizer(spec.vocab_size, spec.arch, tokenizer_texts)
        config = build_config(spec, tokenizer)
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "tiny_target.json").write_text(json.dumps({"spec": spec.__dict__, "mask_token": MASK_TOKEN}))
    return out_dir
