"""Sub-commands generated from their schema config dataclasses: one flag per field, nothing else.

A :class:`ConfigCommand` turns a config dataclass (``peagle/schemas``) into a typer command: every
field is ``--field-name`` (or a positional argument, where the command says so), its docstring the
help text, its default the flag's default (written once, in the dataclass), and its type the
flag's type. So a command and its config cannot drift apart; a new field is a new flag with no
edit here (tests hold them 1:1). The config's ``__post_init__`` validates the values. A config made of
component configs (``TrainConfig.optim``, ...) gives one flag per plain field of each part, named as
the field (``--lr``, not ``--optim.lr``): the parts are the code's structure, not the user's
(:mod:`peagle.schemas.components`).

How types become flags:

* ``str``, ``int``, ``float``, ``X | None``: one value;
* ``bool``: ``--name/--no-name``;
* ``tuple[X, ...]``: a repeatable flag (``--store a --store b``), or, for the fields a command names
  in ``comma_lists``, one comma-separated value (``--mode offline,online``, ``--aux-layers 2,8,13``);
* ``more_values``: a tuple field that also takes the command's trailing positional values (so
  ``--data a.jsonl b.jsonl`` works);
* ``old_positional``: a field that earlier releases took as a positional argument (``peagle vocab
  STORE``): the positional form still works, with a one-line deprecation note on stderr;
* ``choices``: a ``str`` field the parser checks against a fixed list (``--target smollm2|tiny``), so
  a typo is a usage error naming the choices; its config checks the same list (it is also built
  from Python).

Every value has an upper-case placeholder in ``--help`` (``STORE``, ``MODEL_DIR``, ``N`` for an
integer, ``NUM`` for a number, ``TEXT``) or its choices (``bf16|fp8``), the same in every command
(:class:`PeagleCommand`). ``--out`` naming an existing file, or a place inside a shard store (or, for
`peagle train`, inside another run), is one line, before anything runs (:func:`check_out_place`).
``--config FILE`` (YAML or TOML, keys = flag names) supplies defaults for any of them.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand

from peagle.cli.config_file import ConfigOption
from peagle.schemas.checkpoint import CHECKPOINTS_DIR
from peagle.schemas.components import Leaf, from_flat, leaves
from peagle.schemas.errors import UserError
from peagle.schemas.fields import field_docs
from peagle.schemas.store import STORE_SETTINGS_FILE


TYPE_METAVARS = {int: "N", float: "NUM", str: "TEXT"}
"""Placeholders of values whose command names none (``--topk N``)."""


class PeagleCommand(TyperCommand):
    """A typer command whose help writes every value as its placeholder alone: ``SOURCE``, not typer's
    ``{SOURCE}`` (usage) or ``SOURCE <str>`` (arguments). Hidden parameters stay out of the usage line."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if not getattr(param, "hidden", False):
                pieces += [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in param.get_usage_pieces(ctx)]
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                name = (param.metavar or param.name.upper()) + ("..." if param.nargs != 1 else "")
                args.append((name, record[1]))
            else:
                opts.append(record)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def check_out_is_not_a_file(out: Any) -> None:
    """``--out`` names a directory to create or continue; an existing file there is one line, before
    any work (not a traceback after it).

    Raises:
        UserError: ``out`` exists and is not a directory.
    """
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file; --out names a directory (a new one, or one this command "
                        "wrote before)")


STORE_WRITERS = ("peagle extract", "peagle store convert")
"""The commands whose ``--out`` is a shard store."""


def check_out_place(out: Any, command: str) -> None:
    """``--out`` must not put one thing's files among another's: no command writes inside a shard store
    (its readers would meet files no commit record covers, and a re-extraction could delete them), only
    the store writers (:data:`STORE_WRITERS`) write into one, and `peagle train` does not start a run
    inside another run's directory (the outer run's rotation and resume would see its files).

    Raises:
        UserError: one line naming the store or run that holds ``out``.
    """
    if out is None:
        return
    path = Path(out).resolve()
    for parent in path.parents:
        if (parent / STORE_SETTINGS_FILE).is_file():
            raise UserError(f"--out {out} is inside the shard store {parent}; `{command}` would write among the "
                            "store's files: choose a directory outside it")
        if command == "peagle train" and (parent / CHECKPOINTS_DIR).is_dir():
            raise UserError(f"--out {out} is inside the run directory {parent}; a run inside another would mix "
                            "their checkpoints: choose a directory outside it")
    if command not in STORE_WRITERS and (path / STORE_SETTINGS_FILE).is_file():
        raise UserError(f"--out {out} is a shard store; `{command}` would write among the store's files: choose "
                        "another directory")


def _field_type(leaf: Leaf) -> tuple[Any, bool]:
    """(the field's type without ``None``, whether ``None`` is allowed)."""
    hint = typing.get_type_hints(leaf.owner)[leaf.name]
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def _own_fields_first(cls: type) -> list[Leaf]:
    """The config's plain fields, each part's in its place (``TrainConfig.cod``: --num-depths, ...), its
    own before those it takes from a base (the tracker flags train and eval share come last in
    ``--help``, after the command's own)."""
    own = set(vars(cls).get("__annotations__", {}))
    return sorted(leaves(cls), key=lambda leaf: leaf.part is None and leaf.name not in own)


def _tuple_item(tp: Any) -> Any | None:
    """``X`` for ``tuple[X, ...]``, else None."""
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        return args[0] if len(args) == 2 and args[1] is Ellipsis else None
    return None


def split_list(text: Any, item: type, flag: str) -> tuple:
    """``"2,8,13"`` (or ``"2 8 13"``, ``"[2, 8, 13]"``, a list from a config file) -> ``(2, 8, 13)``."""
    parts = [str(p) for p in text] if isinstance(text, (list, tuple)) else \
        str(text).strip().strip("[]()").replace(",", " ").split()
    try:
        return tuple(item(p) for p in parts)
    except ValueError as err:
        kind = "integers like 2,8,13" if item is int else f"{item.__name__} values"
        raise UserError(f"--{flag} must be comma-separated {kind}, got {text!r}") from err


@dataclass(frozen=True, kw_only=True)
class ConfigCommand:
    """One sub-command whose flags are the fields of ``config_class`` (module docstring)."""

    name: str
    group: str = ""
    """The command group it belongs to (`store`), for the lines that name the command."""
    config_class: type
    run: Callable[..., Any]
    """Called with the built config (and the context, where ``pass_context``)."""
    help: str
    arguments: tuple[str, ...] = ()
    """Fields taken as positional arguments, in this order."""
    more_values: str | None = None
    old_positional: str | None = None
    """A field that earlier releases took as a positional argument (still taken, with a note)."""
    comma_lists: frozenset[str] = frozenset()
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Fields whose value the parser checks against these (their placeholder: ``a|b``)."""
    metavars: dict[str, str] = field(default_factory=dict)
    pass_context: bool = False
    """Call ``run(config, ctx)``: for a command that reads the root options from ``ctx.meta`` (``peagle
    --verbose demo`` passes --verbose on to each stage it runs)."""

    @property
    def more_name(self) -> str:
        return f"more_{self.more_values}"

    @property
    def command_path(self) -> str:
        return f"peagle {self.group} {self.name}" if self.group else f"peagle {self.name}"

    @property
    def old_name(self) -> str:
        return f"positional_{self.old_positional}"

    def _metavar(self, name: str, tp: Any) -> str | None:
        if name in self.choices:
            return self.metavars.get(name) or "|".join(self.choices[name])
        return self.metavars.get(name) or TYPE_METAVARS.get(_tuple_item(tp) or tp)

    def _choice_type(self, name: str) -> type[enum.Enum]:
        """A ``str`` enum of the field's choices: typer makes a parameter of that type a checked choice."""
        return enum.Enum(f"{self.config_class.__name__}_{name}", {c: c for c in self.choices[name]}, type=str)

    def parameters(self) -> list[inspect.Parameter]:
        params = []
        for leaf in _own_fields_first(self.config_class):
            f, (tp, optional) = leaf.field, _field_type(leaf)
            item = _tuple_item(tp)
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = ... if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            flag = "--" + f.name.replace("_", "-")
            if item is not None and f.name in self.comma_lists:
                annotation = Optional[str]
                if default not in (None, ...):
                    default = ",".join(map(str, default))
            elif item is not None:
                annotation = Optional[list[item]]
                if required and f.name == self.more_values:
                    default = None  # the values may all come positionally; the config checks there are some
                elif default not in (None, ...):
                    default = list(default)
            elif f.name in self.choices:
                annotation = self._choice_type(f.name)
                annotation = Optional[annotation] if optional else annotation
                default = default if default in (None, ...) else annotation(default)
            else:
                annotation = Optional[tp] if optional else tp
            if f.name == self.old_positional:
                annotation, default = Optional[tp], None  # may come positionally; build() checks it came
            metavar = self._metavar(f.name, tp)
            help_text = field_docs(leaf.owner)[f.name] + ("  [required]" if f.name == self.old_positional else "")
            if f.name in self.arguments:
                option = typer.Argument(default, help=help_text, metavar=metavar, show_default=not required)
            else:
                decls = [f"{flag}/--no-{flag[2:]}"] if annotation is bool else [flag]
                option = typer.Option(default, *decls, help=help_text, metavar=metavar, show_default=not required)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))
        if self.more_values is not None:
            more = typer.Argument(None, metavar=self.metavars.get(self.more_values), show_default=False,
                                  help=f"More values of --{self.more_values.replace('_', '-')} (so "
                                       f"`--{self.more_values.replace('_', '-')} A B` works).")
            params.append(inspect.Parameter(self.more_name, inspect.Parameter.KEYWORD_ONLY, default=more,
                                            annotation=Optional[list[str]]))
        if self.old_positional is not None:
            old = typer.Argument(None, metavar=self.metavars.get(self.old_positional), hidden=True, show_default=False)
            params.append(inspect.Parameter(self.old_name, inspect.Parameter.KEYWORD_ONLY, default=old,
                                            annotation=Optional[str]))
        params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=ConfigOption,
                                        annotation=Optional[str]))
        return params

    def _take_old_positional(self, values: dict[str, Any], flags: dict[str, Any]) -> None:
        """Fold the deprecated positional form into its flag (a note on stderr), or say the flag is missing."""
        name, old = self.old_positional, flags.get(self.old_name)
        flag = "--" + name.replace("_", "-")
        placeholder = self.metavars.get(name, name.upper())
        if old is not None:
            if values.get(name) is not None and values[name] != old:
                raise UserError(f"{flag} {values[name]} and the positional {old} name two values; pass {flag} only")
            print(f"peagle: note: `{self.command_path} {placeholder}` is deprecated (it goes in the next release); "
                  f"write `{self.command_path} {flag} {placeholder}`", file=sys.stderr)
            values[name] = old
        if values.get(name) is None:
            raise UserError(f"missing option {flag} {placeholder}. See `{self.command_path} --help`.")

    def build(self, flags: dict[str, Any]) -> Any:
        """The config from parsed flag values (``config`` and the extra positional values folded in)."""
        values = {k: v for k, v in flags.items() if k not in ("config", self.more_name, self.old_name)}
        if self.old_positional is not None:
            self._take_old_positional(values, flags)
        if self.more_values is not None:
            values[self.more_values] = tuple(values.get(self.more_values) or ()) + tuple(flags.get(self.more_name) or ())
        for leaf in leaves(self.config_class):
            item, name = _tuple_item(_field_type(leaf)[0]), leaf.name
            value = values.get(name)
            if isinstance(value, enum.Enum):
                values[name] = value.value
            if item is not None and value is not None:
                values[name] = (split_list(value, item, name.replace("_", "-")) if name in self.comma_lists
                                else tuple(value))
        return from_flat(self.config_class, values)

    def register(self, app: typer.Typer) -> None:
        def command(ctx: typer.Context, **flags: Any) -> None:
            config = self.build(flags)
            check_out_is_not_a_file(getattr(config, "out", None))
            check_out_place(getattr(config, "out", None), self.command_path)
            if self.pass_context:
                self.run(config, ctx)
            else:
                self.run(config)

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = inspect.Signature([context, *self.parameters()])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in command.__signature__.parameters.values()}  # type: ignore[attr-defined]
        command.__name__ = command.__qualname__ = f"{self.name}_command"
        app.command(self.name, help=self.help, cls=PeagleCommand)(command)

    def parse(self, app: typer.Typer, argv: list[str]) -> Any:
        """The config ``peagle NAME ARGV`` would run with (flags and ``--config`` files parsed, not run)."""
        import typer.main

        command = typer.main.get_command(app).commands[self.name]
        with command.make_context(self.name, list(argv)) as ctx:
            return self.build(ctx.params)
