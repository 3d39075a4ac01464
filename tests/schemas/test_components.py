"""Configs made of parts, read and written flat (schemas/components.py): each part's fields are leaves
under their own names, and flat mappings build the parts and come back out unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from peagle.schemas.components import from_flat, leaves, to_flat


@dataclass(frozen=True, kw_only=True)
class Part:
    rate: float = 0.5
    steps: int = 3


@dataclass(frozen=True, kw_only=True)
class Needs:
    path: str


@dataclass(frozen=True, kw_only=True)
class Whole:
    needs: Needs
    name: str = "x"
    part: Part = field(default_factory=Part)


@dataclass(frozen=True, kw_only=True)
class Clash:
    part: Part = field(default_factory=Part)
    rate: float = 1.0


def test_a_parts_fields_are_leaves_in_its_place():
    assert [(leaf.name, leaf.owner, leaf.part) for leaf in leaves(Whole)] == [
        ("path", Needs, "needs"), ("name", Whole, None), ("rate", Part, "part"), ("steps", Part, "part")]


def test_flat_values_build_the_parts_and_come_back_out():
    built = from_flat(Whole, {"path": "p", "rate": 0.25})
    assert built == Whole(needs=Needs(path="p"), part=Part(rate=0.25))
    assert to_flat(built) == {"path": "p", "name": "x", "rate": 0.25, "steps": 3}
    assert from_flat(Whole, to_flat(built)) == built
    assert from_flat(Whole, {"path": "p", "part": Part(steps=9)}).part.steps == 9  # a part given whole


def test_unknown_names_and_a_part_given_twice_are_refused():
    with pytest.raises(TypeError, match="Whole has no field 'ratee'"):
        from_flat(Whole, {"path": "p", "ratee": 1})
    with pytest.raises(TypeError, match=r"part given whole and by its fields \['rate'\]"):
        from_flat(Whole, {"path": "p", "part": Part(), "rate": 0.1})


def test_a_name_in_two_parts_is_an_internal_error():
    """Flat names are the flags: one name, one field."""
    with pytest.raises(AssertionError, match="a field name given twice"):
        leaves(Clash)
