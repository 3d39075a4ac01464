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


TOOLS = [
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the documentation for a phrase.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "count_rows", "description": "Count the rows of a table.",
        "parameters": {"type": "object", "properties": {"table": {"type": "string"}}, "required": ["table"]}}},
]


def agentic_record(rng: random.Random) -> dict:
    """One conversation shaped like current chat data: a system prompt, reasoning on assistant
    turns (``reasoning_content``), and tool calls (OpenAI form, one per message) answered by
    ``tool`` messages, with the tool list in ``tools``. About one in three has no tools."""
    with_tools = rng.random() < 0.65
    messages: list[dict] = [{"role": "system", "content": _sentence(rng, 4, 9)}] if rng.random() < 0.6 else []
    for _ in range(rng.randint(1, 2)):
        messages.append({"role": "user", "content": _sentence(rng, 5, 16)})
        if with_tools and rng.random() < 0.7:
            tool = rng.choice(TOOLS)["function"]
            argument = next(iter(tool["parameters"]["properties"]))
            call = {"id": f"call{rng.randrange(10**5):05d}", "type": "function",
                    "function": {"name": tool["name"], "arguments": {argument: _sentence(rng, 1, 3)}}}
            turn = {"role": "assistant", "content": "", "tool_calls": [call]}
            if rng.random() < 0.5:
                turn["reasoning_content"] = _sentence(rng, 4, 10)
            messages.append(turn)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": _sentence(rng, 3, 10)})
        answer = {"role": "assistant", "content": _sentence(rng, 5, 20)}
        if rng.random() < 0.5:
            answer["reasoning_content"] = _sentence(rng, 5, 14)
        messages.append(answer)
    return {"messages": messages, **({"tools": TOOLS} if with_tools else {})}


def agentic_records(num_records: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [agentic_record(rng) for _ in range(num_records)]


def write_agentic_jsonl(path: str | Path, num_records: int, seed: int = 0) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in agentic_records(num_records, seed)))
    return path
