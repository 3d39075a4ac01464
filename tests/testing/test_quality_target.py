"""The quality benchmark's corpus and target (peagle.testing.quality_target): a fixed split by
object, code and prose in every split, and a cached target whose tokenizer fits the corpus."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from peagle.testing.quality_target import QualityTargetSpec, build_quality_target, chats_hash, quality_chats, split_of
from peagle.demo.tiny_target import TinyTargetSpec


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return quality_chats()


def answers(chats: list[dict]) -> list[str]:
    return [m["content"] for chat in chats for m in chat["messages"] if m["role"] == "assistant"]


def test_split_is_a_fixed_function_of_the_object_key() -> None:
    keys = [f"module{i}.function{i}" for i in range(4000)]
    assert [split_of(k) for k in keys] == [split_of(k) for k in keys]
    shares = Counter(split_of(k) for k in keys)
    assert abs(shares["target"] / 4000 - 0.85) < 0.03 and abs(shares["draft"] / 4000 - 0.12) < 0.02
    assert abs(shares["heldout"] / 4000 - 0.03) < 0.01


def test_corpus_is_code_and_prose_in_every_split(splits) -> None:
    assert len(splits["target"]) > 10_000 and len(splits["draft"]) > 1_500 and len(splits["heldout"]) > 300
    for name, chats in splits.items():
        texts = answers(chats)
        code = sum(t.lstrip().startswith(("def ", "async def ", "class ", "@")) for t in texts)
        reference = sum(1 for c in chats if "Python" in c["messages"][0]["content"] and "reference" in
                        c["messages"][0]["content"] or "Explain" in c["messages"][0]["content"])
        assert 0.3 < code / len(texts) < 0.9, name  # both kinds, neither dominant
        assert reference > 0, name
        assert all(c["messages"][0]["role"] == "user" and c["messages"][1]["role"] == "assistant" for c in chats)
        assert any(len(c["messages"]) == 4 for c in chats), name  # some two-turn chats
    assert max(len(a) for a in answers(splits["target"])) <= 800


def test_no_question_is_shared_between_splits(splits) -> None:
    questions = {name: {c["messages"][0]["content"] for c in chats} for name, chats in splits.items()}
    assert not questions["heldout"] & questions["target"] and not questions["heldout"] & questions["draft"]
    assert not questions["draft"] & questions["target"]
    # Test suites and generated codec tables are left out of the corpus.
    assert not any("`test." in q or "encodings." in q for qs in questions.values() for q in qs)


def test_corpus_pieces_are_deterministic() -> None:
    """The whole corpus is these pieces in sorted file order under one seeded rng (its hash is part
    of the target's cache key): equal inputs give equal chats."""
    import random

    from peagle.testing.quality_target import _code_chats, _module_files, _reference_chats

    files = _module_files()
    assert files == sorted(files, key=lambda f: f[1]) and not any(name.startswith("test.") for name, _ in files)
    name, path = next((n, p) for n, p in files if n == "json.decoder")
    source = path.read_text()
    assert _code_chats(name, source, 800, random.Random(3)) == _code_chats(name, source, 800, random.Random(3))
    assert _reference_chats(800, random.Random(3)) == _reference_chats(800, random.Random(3))


def test_target_is_built_once_and_cached(tmp_path, splits) -> None:
    spec = QualityTargetSpec(base=TinyTargetSpec(num_layers=8, hidden_size=64, num_heads=2, num_kv_heads=1,
                                                 intermediate_size=96, vocab_size=512),
                             max_steps=2, batch_size=2, seq_len=32, max_target_chats=40)
    logs: list[str] = []
    out = build_quality_target(tmp_path, spec, splits=splits, log=logs.append)
    info = json.loads((out / "quality_target.json").read_text())
    assert info["steps"] == 2 and info["training_chats_sha256"] == chats_hash(splits["target"][:40]) and logs
    assert out.name == f"quality-target-{spec.cache_key(chats_hash(splits['target'][:40]))}"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary directory left behind
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    logs.clear()
    assert build_quality_target(tmp_path, spec, splits=splits, log=logs.append) == out
    assert not logs and (out / "model.safetensors").stat().st_mtime_ns == mtime

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    vocab = tokenizer.get_vocab()
    assert "ĠĠĠ" in vocab and "self" in vocab  # indentation and identifiers of code got their own tokens
    # Another spec is another cache entry.
    assert spec.cache_key("a") != spec.cache_key("b") != QualityTargetSpec().cache_key("b")
