"""``--config FILE`` support: a YAML/TOML file whose keys are flag names supplies flag defaults.

Used as an eager typer option callback: it fills ``ctx.default_map`` before the other options are
parsed, so command-line flags still win. Unknown keys are an error naming the key (a typo in a
config file must not be silently ignored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from peagle.schemas.errors import UserError


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as err:  # parse errors of either format
        raise UserError(f"config file {path} does not parse: {str(err).splitlines()[0]}") from err
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def config_callback(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    if not value:
        return value
    data = load_config_file(value)
    known = {p.name for p in ctx.command.params if p.name != "config"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"config file {value}: unknown key {unknown[0]!r} (keys are the flags of "
                        f"`peagle {ctx.command.name}`, e.g. {sorted(known)[:3]})")
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return value


ConfigOption = typer.Option(
    None, "--config", help="YAML or TOML file whose keys are this command's flags (flags given here win).",
    is_eager=True, callback=config_callback, exists=False, metavar="FILE",
)
