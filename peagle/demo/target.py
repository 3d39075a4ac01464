"""The demo's target: a tiny Llama trained for a few minutes on stdlib documentation, cached.

A random-weight target predicts noise, so a draft trained on it says nothing about acceptance.
This one learns a real (small) language: chats in which a user asks about a Python stdlib object
and the assistant answers with its docstring. The corpus ships with Python, so the demo needs no
download; the target trains in a few minutes on 2 CPU cores and is cached by its settings' hash.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle.demo.stdlib_docs import stdlib_docs
from peagle.demo.target_training import LmTraining, cached_model_dir, chat_token_windows, train_lm
from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target

DEMO_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "html", "http", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "mailbox", "math", "operator", "optparse", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "smtplib",
    "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "trace", "typing", "unittest", "urllib", "uuid",
    "warnings", "wave", "weakref", "xml", "zipfile", "zlib",
)
QUESTIONS = ("What does {name} do?", "Explain {name}.", "Describe {name} in Python.", "How do I use {name}?")


@dataclass(frozen=True, kw_only=True)
class DemoTargetSpec:
    """Everything that changes the demo target; its hash names the cache entry."""

    base: TinyTargetSpec = TinyTargetSpec(arch="llama", num_layers=8, hidden_size=128, num_heads=4,
                                          num_kv_heads=2, intermediate_size=384, vocab_size=1024)
    # A step budget, not a time budget: the target (and every figure measured on it) must not depend
    # on how busy the machine was when it trained. A time budget once cached a 7-step target on a
    # loaded machine. 200 steps take about 2 minutes on 2 quiet cores.
    max_steps: int = 200
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    max_answer_chars: int = 700
    seed: int = 0
    # 2: the chats are the stdlib's classes and functions only, collected in a fresh interpreter, so
    # the same in every process (1 also took module globals, and what the process had imported changed them)
    corpus: int = 2

    def cache_key(self) -> str:
        blob = json.dumps({"spec": asdict(self), "python": sys.version_info[:2]}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def demo_chats(max_answer_chars: int = 700, seed: int = 0) -> list[dict]:
    """Chat records (OpenAI messages) from stdlib docstrings: question about a name -> its docstring,
    the same in every process (peagle.demo.stdlib_docs)."""
    rng = random.Random(seed)
    chats = []
    for mod_name, attr, doc in stdlib_docs(DEMO_MODULES):
        answer = doc[:max_answer_chars].rsplit(" ", 1)[0] if len(doc) > max_answer_chars else doc
        question = rng.choice(QUESTIONS).format(name=f"{mod_name}.{attr}")
        chats.append({"messages": [{"role": "user", "content": question},
                                   {"role": "assistant", "content": answer}]})
    rng.shuffle(chats)
    return chats


def build_demo_target(cache_dir: str | Path, spec: DemoTargetSpec = DemoTargetSpec(), *,
                      log=print) -> Path:
    """Return the trained demo target directory, training it first if the cache has none.

    Training runs exactly ``max_steps`` steps (the weights depend on the spec alone, not on the
    machine's speed or load). The result is written atomically.
    """

    def build(work: Path) -> Path:
        import torch

        from peagle.model.target.directory import load_causal_lm, load_tokenizer

        base = build_tiny_target(work / "base", spec.base)
        tokenizer = load_tokenizer(base)
        model = load_causal_lm(base, torch.float32, "cpu")  # train_lm puts it in training mode
        chats = demo_chats(spec.max_answer_chars, spec.seed)
        windows = chat_token_windows(tokenizer, chats, spec.seq_len, spec.seed)
        log(f"training the demo target ({len(chats)} stdlib docstring chats, {spec.max_steps} steps)")
        stats = train_lm(model, windows, LmTraining(
            max_steps=spec.max_steps, seq_len=spec.seq_len, batch_size=spec.batch_size, lr=spec.lr,
            seed=spec.seed), log=log)
        final = work / "model"
        model.save_pretrained(final)
        tokenizer.save_pretrained(final)
        (final / "demo_target.json").write_text(json.dumps({"spec": asdict(spec), **stats}, indent=1, default=str))
        return final

    return cached_model_dir(cache_dir, f"demo-target-{spec.cache_key()}", build)
