"""Small synthetic chat files for tests and benchmarks (deterministic, offline, any size).

Records are OpenAI ``messages`` conversations of 1-3 user/assistant exchanges (some with a system
prompt) built from a fixed word list, so the same (num_records, seed) always gives the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a model token shard store layer hidden state draft target vocab sample batch record file "
    "parse write read commit rename sync disk queue thread worker plan index offset mask loss rank "
    "step train eval export config value list tuple string number python function class method "
    "return yield import module package error line column table tensor float integer byte"
).split()


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice(".?!")


def chat_record(rng: random.Random, *, min_words: int = 4, max_words: int = 24) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _sentence(rng, 3, 8)})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _sentence(rng, min_words, max_words)})
        messages.append({"role": "assistant", "content": _sentence(rng, min_words, max_words)})
    return {"messages": messages}


def chat_records(num_records: int, seed: int = 0, **kwargs) -> list[dict]:
    rng = random.Random(seed)
    return [chat_record(rng, **kwargs) for _ in range(num_records)]


def write_chat_jsonl(path: str | Path, num_records: int, seed: int = 0, *, bad_lines: dict[int, str] | None = None,
                     **kwargs) -> Path:
    """Write ``num_records`` lines; ``bad_lines`` replaces line i (0-based) with the given raw text."""
    path = Path(path)
    lines = [json.dumps(r) for r in chat_records(num_records, seed, **kwargs)]
    for i, text in (bad_lines or {}).items():
        lines[i] = text
    path.write_text("".join(line + "\n" for line in lines))
    return path
