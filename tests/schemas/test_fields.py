"""Field docstrings: read from the source, folded to one line, required for every field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from peagle.schemas.demo_config import DemoConfig
from peagle.schemas.eval_config import EvalConfig
from peagle.schemas.export_config import ExportConfig
from peagle.schemas.extract_config import ExtractConfig
from peagle.schemas.fields import field_docs
from peagle.schemas.train_config import TrainConfig


@dataclass
class Documented:
    size: int = 1
    """How many,
    over two lines."""

    name: str = "x"
    """A name."""


@dataclass
class Undocumented:
    size: int = 1
    """How many."""

    name: str = "x"


def test_docstrings_under_fields_are_folded():
    assert field_docs(Documented) == {"size": "How many, over two lines.", "name": "A name."}


def test_a_field_without_a_docstring_is_an_internal_error():
    with pytest.raises(AssertionError, match=r"fields without a docstring: \['name'\]"):
        field_docs(Undocumented)


def test_every_config_field_has_help():
    for cls in (ExtractConfig, TrainConfig, ExportConfig, EvalConfig, DemoConfig):
        assert set(field_docs(cls)) == set(cls.__dataclass_fields__)
