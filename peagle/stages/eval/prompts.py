"""Prompts for online evaluation: from a file, from held-out store samples, or a built-in few.

* ``--prompts FILE``: JSONL, one prompt per line, as ``{"messages": [...]}`` (rendered with the
  target's chat template and the generation prompt), ``{"prompt": "text"}`` (tokenized as is), or
  ``{"prompt_token_ids": [...]}``; or a ``.txt`` file whose every non-empty line is one user message.
* A store: each sample's tokens before its first supervised token, i.e. the conversation up to the
  first assistant reply the draft was (or, held out, was not) trained to predict.
* Neither: a few built-in user messages through the chat template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from peagle.model.target.directory import read_generation_config
from peagle.pipeline.store_reader import TrainingSample
from peagle.schemas.errors import UserError

BUILTIN_MESSAGES = (
    "Explain what a context manager is in Python and when to use one.",
    "Write a short function that parses a CSV line into fields.",
    "What does the logging module's basicConfig do?",
    "Describe how argparse handles optional arguments.",
    "How do I join two paths with pathlib?",
    "Summarize what unittest.TestCase provides.",
    "What is the difference between a list and a tuple?",
    "Give an example of textwrap.dedent.",
)


def render_messages(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prompt_lines(path: str | os.PathLike) -> list[str]:
    """The non-blank lines of a prompts file, checked before any model is loaded.

    Why: an empty file would give a report of 0 prompts that reads like a result (exit 0).

    Raises:
        UserError: the file is missing or unreadable, or holds no non-blank line (naming it).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts {path} does not exist")
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read --prompts {path}: {getattr(err, 'strerror', None) or err}") from err
    if not lines:
        raise UserError(f"--prompts {path} holds no prompt ({'it is empty' if not path.stat().st_size else 'only blank lines'})")
    return lines


def prompts_from_file(path: str | os.PathLike, tokenizer: Any) -> list[list[int]]:
    """Token ids of every prompt in ``path`` (module docstring).

    Raises:
        UserError: for a missing file or a line that is none of the accepted forms.
    """
    lines = prompt_lines(path)
    path = Path(path)
    if path.suffix == ".txt":
        return [render_messages(tokenizer, [{"role": "user", "content": line.strip()}]) for line in lines]
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"--prompts {path} line {number} is not JSON ({err.msg})") from err
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            messages = [m for m in record["messages"] if m.get("role") != "assistant"] or record["messages"]
            prompts.append(render_messages(tokenizer, messages))
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append([int(t) for t in tokenizer(record["prompt"])["input_ids"]])
        elif isinstance(record, dict) and isinstance(record.get("prompt_token_ids"), list):
            prompts.append([int(t) for t in record["prompt_token_ids"]])
        else:
            raise UserError(f"--prompts {path} line {number}: expected messages, prompt or prompt_token_ids")
    if not prompts:
        raise UserError(f"--prompts {path} holds no prompt")
    return prompts


def prompts_from_samples(samples: Iterable[TrainingSample], max_prompts: int) -> list[list[int]]:
    """The context before the first supervised token of each sample (samples with none are skipped)."""
    prompts = []
    for sample in samples:
        context = sample.context_before_first_target()
        if context is not None:
            prompts.append(context)
        if len(prompts) >= max_prompts:
            break
    return prompts


def builtin_prompts(tokenizer: Any, max_prompts: int) -> list[list[int]]:
    return [render_messages(tokenizer, [{"role": "user", "content": m}]) for m in BUILTIN_MESSAGES[:max_prompts]]


def stop_token_ids(tokenizer: Any, model_dir: str | os.PathLike) -> list[int]:
    """EOS ids of the tokenizer and the generation config (what vLLM stops on by default)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = read_generation_config(model_dir).get("eos_token_id")
    ids.update([int(eos)] if isinstance(eos, int) else [int(e) for e in eos or []])
    return sorted(ids)
