"""Configs built from component configs, read and written as one flat set of names (the flags).

``TrainConfig`` nests one config per part of a run (torchtitan's Config per component): the data
(``DataSettings``), COD sampling (``CodSettings``), the optimizer, checkpointing. Each part
validates its own fields and is handed whole to the code that builds that part, so a new knob of a
part touches its config and its user only. What users and files see stays flat: the flags
(``--lr``, not ``--optimizer.lr``), ``--config`` files, and the ``train_config`` of ``run.json`` and
``config.pt``, which runs written before the parts existed hold and which export, eval and resume
read by these names. A leaf's name is therefore unique across the parts, and these functions map the
flat names to the nested fields and back.

One level only: a part holds plain fields, never another part.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Leaf:
    """One plain field of a config, where it lives: a flag of the command built from the config."""

    name: str
    """The field's name, unique across the config and its parts (``--lr`` is ``lr``)."""
    owner: type
    """The dataclass whose type hints and docstrings describe it (the part, or the config itself)."""
    field: dataclasses.Field
    part: str | None
    """The config's field holding the part, or None for a field of the config itself."""


def part_type(cls: type, f: dataclasses.Field) -> type | None:
    """The component dataclass field ``f`` of ``cls`` holds, or None for a plain field."""
    hint = typing.get_type_hints(cls)[f.name]
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


@functools.cache
def leaves(cls: type) -> tuple[Leaf, ...]:
    """Every plain field of ``cls``, each part's fields in the part's place (declaration order)."""
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        part = part_type(cls, f)
        if part is None:
            out.append(Leaf(f.name, cls, f, None))
            continue
        for g in dataclasses.fields(part):
            assert part_type(part, g) is None, f"{part.__name__}.{g.name}: a part holds no parts"
            out.append(Leaf(g.name, part, g, f.name))
    names = [leaf.name for leaf in out]
    assert len(names) == len(set(names)), f"{cls.__name__}: a field name given twice across its parts"
    return tuple(out)


def from_flat(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls`` built from flat names: each part from its fields' values (the rest its defaults).

    A part may also be given whole, under its own name, when none of its fields is.

    Raises:
        TypeError: a name that is no field (as ``cls(**values)`` would), or a part given whole and by field.
    """
    by_name = {leaf.name: leaf for leaf in leaves(cls)}
    parts = {f.name: part_type(cls, f) for f in dataclasses.fields(cls) if part_type(cls, f) is not None}
    top: dict[str, Any] = {}
    of_part: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        leaf = by_name.get(name)
        if leaf is None and name not in parts:
            raise TypeError(f"{cls.__name__} has no field {name!r}")
        if leaf is not None and leaf.part is not None:
            of_part.setdefault(leaf.part, {})[name] = value
        else:
            top[name] = value
    for name, part in parts.items():
        if name in of_part and name in top:
            raise TypeError(f"{cls.__name__}: {name} given whole and by its fields {sorted(of_part[name])}")
        if name not in top and (name in of_part or _required(cls, name)):
            top[name] = part(**of_part.get(name, {}))
    return cls(**top)


def to_flat(config: Any) -> dict[str, Any]:
    """Every leaf's value under its flat name (the inverse of :func:`from_flat`)."""
    return {leaf.name: getattr(getattr(config, leaf.part) if leaf.part else config, leaf.name)
            for leaf in leaves(type(config))}


def _required(cls: type, name: str) -> bool:
    f = cls.__dataclass_fields__[name]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
