"""The configurations of `peagle store info`, `store verify` and `store convert`: every CLI flag is a
field, its docstring the help (`store check` has its own: ``check_config.CheckConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.store import HIDDEN_DTYPES


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Settings of `peagle store info` and `peagle store verify`: which store."""

    store: str
    """The shard store (written by `peagle extract` or `peagle store convert`)."""


@dataclass(frozen=True, kw_only=True)
class ConvertConfig:
    """Settings of `peagle store convert`."""

    store: str
    """The store to convert (it is only read)."""

    hidden_dtype: str
    """Encoding of the new store's aux hidden states: `fp8` (about half the disk; docs/fp8.md) or `bf16`."""

    out: str
    """The new store (created, or continued after a killed run)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_dtype", dtype_choice("hidden-dtype", self.hidden_dtype, HIDDEN_DTYPES))
