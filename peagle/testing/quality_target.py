"""The quality benchmark's target: a tiny Llama that writes varied code and prose, cached.

The demo's target (:mod:`peagle.demo.target`) answers "what does X do?" with stdlib
docstrings; its greedy text is so formulaic that once a draft gets two tokens right it gets the
rest, and every draft looks the same. To tell drafts apart, this target learns a richer corpus,
all of it shipped with Python (nothing to download, the same on every machine with the same
Python): the *source code* of the standard library (write / show / explain a function, class or
module) and the language reference's prose (``pydoc_data.topics``), as chats shaped like real use.

The corpus is split by the *object* a chat is about (a function, class, module or reference
section), so no held-out question has a twin about the same object in the target's or the
draft's training data:

* ``target`` (~85%): the target's own training text (and its tokenizer's);
* ``draft`` (~12%): prompts whose answers the target regenerates for the draft's training store;
* ``heldout`` (~3%): evaluation prompts and the offline evaluation store.

Two objects can share a question (``__init__(self)`` in two modules); such a question stays only in
the first split that has it (target, then draft), so no held-out question was ever answered in
training.

The target trains for a fixed number of steps (no time limit, so its weights depend only on the
settings and its training chats) and is cached under a hash of both.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import statistics
import sys
import sysconfig
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle.pipeline.atomic import atomic_write_json
from peagle.demo.target_training import LmTraining, cached_model_dir, chat_token_windows, train_lm
from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target

SPLITS = (("target", 0.85), ("draft", 0.97), ("heldout", 1.0))
"""(name, upper bound of the object-key hash fraction): which split a chat's object falls into."""

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                          "tkinter", "ensurepip", "encodings", "pydoc_data", "__pycache__", "__phello__"})
"""Stdlib folders left out: third-party packages, test suites (templated asserts), GUI demos, the
generated codec tables of ``encodings``."""

ASK_WRITE = ("Write a Python function `{sig}` that {summary}.", "Implement `{sig}`: it should {summary}.",
             "Can you show me Python code for `{sig}`? It {summary}.", "I need `{sig}`, which {summary}. Code please.")
ASK_SHOW = ("Show me the source of `{qual}` in `{module}`.", "How is `{qual}` implemented in the {module} module?",
            "Print the code of {module}.{qual}.", "What does the implementation of `{module}.{qual}` look like?")
ASK_EXPLAIN = ("What does `{module}.{qual}` do?", "Explain {module}.{qual}.",
               "Describe `{qual}` from the {module} module.", "I don't understand `{module}.{qual}`. What is it for?")
ASK_MODULE = ("What is the `{module}` module for?", "Give me an overview of the {module} module.",
              "When would I use `{module}`?")
ASK_TOPIC = ("What does the Python language reference say about {topic}?", "Explain {topic} in Python.",
             "How does Python define {topic}?")
ASK_TOPIC_MORE = ("Tell me more about {topic}: {section}.", "Continue the explanation of {topic} ({section}).",
                  "And what about {section}, in {topic}?")
FOLLOW_UP_CODE = ("Show me its code.", "How is it implemented?", "Can I see the source?")


@dataclass(frozen=True, kw_only=True)
class QualityTargetSpec:
    """Everything that shapes the quality target; with the corpus hash it names the cache entry.

    Sized so that training takes about 30 minutes on 2 quiet CPU cores: 8 layers (distinct default
    aux layers), hidden 128 with head_dim 32 (vLLM's CPU attention supports it), a 2048-token BPE
    trained on the corpus itself (code indentation and identifiers get their own tokens).
    """

    base: TinyTargetSpec = TinyTargetSpec(arch="llama", num_layers=8, hidden_size=128, num_heads=4, num_kv_heads=2,
                                          intermediate_size=384, vocab_size=2048)
    max_steps: int = 1000
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    max_answer_chars: int = 800
    max_target_chats: int | None = None
    """Train on only the first this many chats of the ``target`` split (None: all; tests use few)."""
    seed: int = 0

    def cache_key(self, training_chats_hash: str) -> str:
        blob = json.dumps({"spec": asdict(self), "corpus": training_chats_hash, "python": sys.version_info[:2]},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _clip(text: str, max_chars: int) -> str:
    """``text`` cut at the last line break (else space) before ``max_chars``."""
    text = text.strip("\n")
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    return cut[: cut.rfind("\n")] if "\n" in cut else cut.rsplit(" ", 1)[0]


def _summary(doc: str) -> str:
    """A docstring's first sentence as a clause: "Return the sum." -> "returns the sum"-like text."""
    first = doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".").strip()
    return first[:1].lower() + first[1:]


def _module_files() -> list[tuple[str, Path]]:
    """(module name, path) of every stdlib source file outside :data:`SKIPPED_DIRS`, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in SKIPPED_DIRS for part in parts):
            continue
        name = ".".join(parts)[: -len(".py")]
        out.append((name[: -len(".__init__")] if name.endswith(".__init__") else name, path))
    return out


def _code_chats(module: str, source: str, max_chars: int, rng: random.Random) -> list[tuple[str, dict]]:
    """(object key, chat) for a module's docstring, its functions, classes and methods."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    chats: list[tuple[str, dict]] = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= 80:
        chats.append((module, _chat(rng.choice(ASK_MODULE).format(module=module), _clip(doc, max_chars))))
    lines = source.splitlines(keepends=True)
    nodes = [(node, "") for node in tree.body]
    nodes += [(item, node.name + ".") for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body]
    for node, prefix in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        qual = prefix + node.name
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])  # whole lines, decorators too
        code = textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
        if len(code) < 60:
            continue
        code = _clip(code, max_chars)
        doc = ast.get_docstring(node)
        key = f"{module}.{qual}"
        if doc and len(doc) >= 40:
            explain = _chat(rng.choice(ASK_EXPLAIN).format(module=module, qual=qual), _clip(doc, max_chars))
            if rng.random() < 0.3:  # a two-turn chat: explain, then show the code
                explain["messages"] += [{"role": "user", "content": rng.choice(FOLLOW_UP_CODE)},
                                        {"role": "assistant", "content": code}]
            chats.append((key, explain))
            if not isinstance(node, ast.ClassDef) and _summary(doc):
                sig = f"{node.name}({ast.unparse(node.args)})"
                chats.append((key, _chat(rng.choice(ASK_WRITE).format(sig=sig, summary=_summary(doc)), code)))
        else:
            chats.append((key, _chat(rng.choice(ASK_SHOW).format(module=module, qual=qual), code)))
    return chats


def _reference_chats(max_chars: int, rng: random.Random) -> list[tuple[str, dict]]:
    """(object key, chat) per chunk of the language reference's topics (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    chats: list[tuple[str, dict]] = []
    for name in sorted(topics):
        paragraphs = [p.strip("\n") for p in topics[name].split("\n\n") if p.strip()]
        title = paragraphs[0].split("\n")[0].strip() if paragraphs else name
        section, chunk, part = title, [], 0
        for para in paragraphs[1:] + [""]:
            lines = para.split("\n")
            is_heading = len(lines) == 2 and set(lines[1].strip()) <= set("=-*") and lines[1].strip()
            if chunk and (not para or is_heading or sum(map(len, chunk)) + len(para) > max_chars):
                ask = (rng.choice(ASK_TOPIC).format(topic=title) if part == 0 else
                       rng.choice(ASK_TOPIC_MORE).format(topic=title, section=section))
                chats.append((f"reference:{name}:{part}", _chat(ask, _clip("\n\n".join(chunk), max_chars))))
                chunk, part = [], part + 1
            if is_heading:
                section = lines[0].strip()
            elif para:
                chunk.append(para)
    return chats


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def split_of(key: str) -> str:
    """The split an object key belongs to: a fixed function of the key (sha256), never of the order."""
    fraction = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return next(name for name, upper in SPLITS if fraction < upper)


def quality_chats(max_answer_chars: int = 800, seed: int = 0) -> dict[str, list[dict]]:
    """The corpus as ``{split: [chat, ...]}`` (module docstring), each split in a fixed shuffled order."""
    rng = random.Random(seed)
    keyed: list[tuple[str, dict]] = []
    for module, path in _module_files():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        keyed += _code_chats(module, source, max_answer_chars, rng)
    keyed += _reference_chats(max_answer_chars, rng)
    out: dict[str, list[dict]] = {name: [] for name, _ in SPLITS}
    for key, chat in keyed:
        out[split_of(key)].append(chat)
    # Two objects can get the same question (``__init__(self)`` in two modules): a question seen in
    # an earlier split is dropped from the later ones, so the target never saw a held-out question.
    seen: set[str] = set()
    for name, _ in SPLITS:
        out[name] = [c for c in out[name] if c["messages"][0]["content"] not in seen]
        seen |= {c["messages"][0]["content"] for c in out[name]}
    for chats in out.values():
        rng.shuffle(chats)
    return out


def chats_hash(chats: list[dict]) -> str:
    """sha256 of a list of chats: the text a target trains on names its cache entry, so a changed
    stdlib (another Python patch release) is another target."""
    return hashlib.sha256(json.dumps(chats, sort_keys=True).encode()).hexdigest()


def build_quality_target(cache_dir: str | Path, spec: QualityTargetSpec = QualityTargetSpec(), *,
                         splits: dict[str, list[dict]] | None = None, log=print) -> Path:
    """Return the trained quality target directory, training it first if the cache has none.

    ``splits``: the corpus when the caller has already built it (:func:`quality_chats` with the
    spec's settings). The target and its tokenizer see only the ``target`` split.
    """
    splits = splits or quality_chats(spec.max_answer_chars, spec.seed)
    chats = splits["target"][: spec.max_target_chats]

    def build(work: Path) -> Path:
        import torch

        from peagle.model.target.directory import load_causal_lm, load_tokenizer

        texts = [m["content"] for chat in chats for m in chat["messages"]]
        base = build_tiny_target(work / "base", spec.base, tokenizer_texts=texts)
        tokenizer = load_tokenizer(base)
        model = load_causal_lm(base, torch.float32, "cpu")  # train_lm puts it in training mode
        windows = chat_token_windows(tokenizer, chats, spec.seq_len, spec.seed)
        log(f"training the quality target ({len(chats)} chats of stdlib code and reference prose, "
            f"{spec.max_steps} steps of {spec.batch_size} x {spec.seq_len} tokens)")
        stats = train_lm(model, windows, LmTraining(max_steps=spec.max_steps, seq_len=spec.seq_len,
                                                    batch_size=spec.batch_size, lr=spec.lr, seed=spec.seed), log=log)
        final = work / "model"
        model.save_pretrained(final)
        tokenizer.save_pretrained(final)
        (final / "quality_target.json").write_text(json.dumps(
            {"spec": asdict(spec), "training_chats_sha256": chats_hash(chats), **stats,
             "num_chats": {name: len(c) for name, c in splits.items()}}, indent=1, default=str))
        return final

    return cached_model_dir(cache_dir, f"quality-target-{spec.cache_key(chats_hash(chats))}", build)


def text_variety(target: Path, prompts: list[list[dict]], max_new_tokens: int) -> dict:
    """How formulaic a target's greedy answers are: distinct 4-grams within each continuation (1.0:
    no repetition; a loop drives it to 0), pooled over all continuations (low when every answer
    reuses the same phrases: a template), and the share of continuations that loop (< 0.5)."""
    import torch

    from peagle.model.target.directory import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(target)
    model = load_causal_lm(target, torch.float32, "cpu")
    continuations = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        continuations.append(out[0, ids.shape[1]:].tolist())

    def grams(tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]

    within = [len(set(grams(c))) / len(grams(c)) for c in continuations if grams(c)]
    pooled = [g for c in continuations for g in grams(c)]
    return {"num_prompts": len(prompts), "mean_tokens": statistics.fmean(len(c) for c in continuations),
            "distinct_4gram_within": statistics.fmean(within) if within else None,
            "distinct_4gram_pooled": len(set(pooled)) / len(pooled) if pooled else None,
            "looping_share": sum(w < 0.5 for w in within) / len(within) if within else None,
            "example": tokenizer.decode(continuations[0]) if continuations else None}


def cached_text_variety(work: Path, target: Path, prompts: list, max_new_tokens: int) -> dict:
    """``text_variety`` once per target, prompts and length in --work: greedy generation with
    transformers over the prompts costs minutes on 2 cores, and every re-run would pay it again."""
    key = hashlib.sha256(json.dumps([str(target), prompts, max_new_tokens]).encode()).hexdigest()[:16]
    path = work / f"variety-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    variety = text_variety(target, prompts, max_new_tokens)
    atomic_write_json(path, variety)
    return variety
