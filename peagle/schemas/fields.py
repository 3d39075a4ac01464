"""Field docstrings of the config dataclasses: the one source of every CLI flag's help text.

Each config field carries a docstring right under it (as torchtitan's configs do). The CLI reads
them from here for ``--help``, so the config and the help cannot drift apart; every config
(extract, train, ...) shares this one reader.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from dataclasses import fields


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal right under it), whitespace-folded; fields a
    config takes from a base (``TrackingOptions``, shared by train and eval) are read from the base."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    missing = {f.name for f in fields(cls)} - set(docs)
    assert not missing, f"fields without a docstring: {sorted(missing)}"
    return docs
