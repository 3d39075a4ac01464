"""Chats whose answers are documentation already on this machine, for teacher-forced extraction.

    python benchmarks/docs_chats.py --out docs.jsonl --max-chats 2000

A draft's store is the target's own answers, and on a CPU generating them is what costs (~150
tokens/s for SmolLM2-135M on 2 cores). ``peagle extract`` without ``--regenerate`` only runs a
prefill over text that is already written, several times cheaper per token. This writes such
text, with nothing downloaded: Python's reference topics (``pydoc_data``) and the docstrings of the
interpreter's standard library and of the installed packages (the lock pins them, so every machine
with the same lock and Python writes the same file), cut at paragraphs into passages of at most
2,000 characters (2,002 at most), each the answer of a one-line user question about its subject.
``benchmarks/recipe_curves.py`` measures what such a store adds beside the target's answers.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MAX_CHARS = 2000
MIN_CHARS = 300
QUESTIONS = ("Tell me about {}.", "Explain {}.", "What should I know about {}?", "Can you describe {}?",
             "Give me an overview of {}.")


def passages(title: str, text: str) -> Iterator[tuple[str, str]]:
    """``text`` cut at blank lines into passages of MIN_CHARS..MAX_CHARS + 2 characters (a longer
    paragraph is cut short). The rule is kept as the recorded stores were made with it."""
    text = re.sub(r"\n{3,}", "\n\n", inspect.cleandoc(text).strip())
    chunk = ""
    for para in text.split("\n\n"):
        if chunk and len(chunk) + len(para) > MAX_CHARS:  # the separator not counted: up to MAX_CHARS + 2
            if len(chunk) >= MIN_CHARS:
                yield title, chunk
            chunk = ""
        chunk = f"{chunk}\n\n{para}" if chunk else para[:MAX_CHARS]
    if len(chunk) >= MIN_CHARS:
        yield title, chunk


def docstrings(root: Path) -> Iterator[tuple[str, str]]:
    """Prose docstrings (mostly letters and spaces) of modules, classes and functions under ``root``,
    tests left out, in path order; parsed, not imported."""
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_CHARS and sum(c.isalpha() or c == " " for c in doc) > 0.8 * len(doc):
                    yield from passages(getattr(node, "name", path.stem), doc)


def docs_chats(max_chats: int, seed: int = 0) -> list[dict]:
    """Up to ``max_chats`` one-turn chats, shuffled with ``seed``, distinct passages only."""
    from pydoc_data.topics import topics

    found = [p for name, text in topics.items() for p in passages(name.replace("-", " "), text)]
    for root in sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}):
        found.extend(docstrings(Path(root)))
    seen: set[str] = set()
    unique = [(t, p) for t, p in found if not (p[:200] in seen or seen.add(p[:200]))]
    random.Random(seed).shuffle(unique)
    return [{"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(title)},
                          {"role": "assistant", "content": passage}]}
            for i, (title, passage) in enumerate(unique[:max_chats])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL of OpenAI-style chats")
    parser.add_argument("--max-chats", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    chats = docs_chats(args.max_chats, args.seed)
    args.out.write_text("".join(json.dumps(c) + "\n" for c in chats))
    chars = sum(len(c["messages"][1]["content"]) for c in chats)
    print(f"{len(chats)} chats, {chars:,} characters of answers -> {args.out}")


if __name__ == "__main__":
    main()
