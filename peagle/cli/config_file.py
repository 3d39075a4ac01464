"""``--config FILE`` support: a YAML/TOML file whose keys are flag names supplies flag defaults.

Used as an eager typer option callback: it fills ``ctx.default_map`` before the other options are
parsed, so command-line flags still win. Unknown keys are an error naming the key (a typo in a
config file must not be silently ignored), and so is what a parser would take silently: a key given
twice (YAML keeps the last), one flag spelled both ``a-b`` and ``a_b``, and ``true`` or ``2.5`` where an
integer belongs (docs/reliability.md, "What peagle trusts").
"""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path
from typing import Any

import typer

from peagle.schemas.errors import UserError


def _yaml_loader() -> type:
    """PyYAML's safe loader, refusing a key given twice in one mapping (it keeps the last, silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # noqa: ANN001 - PyYAML's signature
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise DuplicateKey(str(key), key_node.start_mark.line + 1)
                seen[key] = True
            return super().construct_mapping(node, deep=deep)

    return Loader


class DuplicateKey(Exception):
    def __init__(self, key: str, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


def _toml_duplicate(text: str, err: Exception) -> str | None:
    """The key a TOML parse error refused as given twice (tomllib names only the line), or None."""
    found = re.search(r"line (\d+)", str(err))
    if not found or not re.search(r"overwrite|twice|already", str(err), re.IGNORECASE):
        return None
    lines = text.splitlines()
    number = int(found.group(1))
    line = lines[number - 1] if 0 < number <= len(lines) else ""
    key = line.split("=", 1)[0].strip().strip("[]").strip()
    return key or None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The file's keys (``-`` spelled ``_``) and values.

    Raises:
        UserError: one line naming the file and the key: a file that does not exist or parse, a key given
            twice (YAML or TOML), one flag spelled two ways (``max-steps`` and ``max_steps``), or a file
            that holds no mapping.
    """
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

            data = yaml.load(text, Loader=_yaml_loader()) or {}  # noqa: S506 - a SafeLoader subclass
    except DuplicateKey as err:
        raise UserError(f"config file {path}: key {err.key!r} is given twice (line {err.line}); give each key "
                        "once") from None
    except Exception as err:  # parse errors of either format
        key = _toml_duplicate(text, err) if path.suffix == ".toml" else None
        if key is not None:
            raise UserError(f"config file {path}: key {key!r} is given twice; give each key once") from None
        raise UserError(f"config file {path} does not parse: {str(err).splitlines()[0]}") from err
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of flag names to values")
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in spelled:
            raise UserError(f"config file {path}: {spelled[name]!r} and {str(key)!r} are one flag spelled two ways; "
                            "give it once")
        spelled[name], out[name] = str(key), value
    return out


def _number_kind(annotation: Any) -> type | None:
    """``int`` or ``float`` for a flag annotated so (also ``X | None`` and ``list[X]``), else None."""
    for _ in range(3):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if not args:
            break
        annotation = args[0]
    return annotation if annotation in (int, float) else None


def check_value_types(ctx: typer.Context, data: dict[str, Any], path: str) -> None:
    """Refuse what the parser would quietly turn into a number: ``true`` (1) where an integer or a number
    belongs, and ``2.5`` (2) where an integer belongs. Lists are checked item by item. The types are
    the command's own annotations (``ConfigCommand`` makes them from the config's fields).

    Raises:
        UserError: one line naming the file, the key and the value.
    """
    try:
        parameters = inspect.signature(ctx.command.callback).parameters
    except (TypeError, ValueError):  # a command without a Python signature: nothing to check against
        return
    for name, value in data.items():
        kind = _number_kind(parameters[name].annotation) if name in parameters else None
        if kind is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, bool) or (kind is int and isinstance(item, float)):
                wanted = "an integer" if kind is int else "a number"
                raise UserError(f"config file {path}: key {name.replace('_', '-')!r} takes {wanted}, got {item!r}")


def config_callback(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    if not value:
        return value
    data = load_config_file(value)
    known = {p.name for p in ctx.command.params if p.name != "config"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"config file {value}: unknown key {unknown[0]!r} (keys are the flags of "
                        f"`peagle {ctx.command.name}`, e.g. {sorted(known)[:3]})")
    check_value_types(ctx, data, value)
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return value


ConfigOption = typer.Option(
    None, "--config", help="YAML or TOML file whose keys are this command's flags (flags given here win).",
    is_eager=True, callback=config_callback, exists=False, metavar="FILE",
)
