"""The ``peagle`` command: one typer app, one thin module per sub-command.

Each sub-command module parses flags into its stage's config dataclass (peagle/schemas) and calls
the stage. ``--config FILE`` (YAML or TOML) supplies defaults for any flag; its keys are the flag
names (``aux-layers`` or ``aux_layers``). Flags given on the command line win over the file.
User errors (``UserError``) print one line on stderr and exit 2; never a traceback.
"""

from __future__ import annotations

import os
import sys

import typer

from peagle.schemas.errors import UserError

app = typer.Typer(
    name="peagle",
    help="Train P-EAGLE (parallel-drafting EAGLE-3) draft models offline and serve them in vLLM.\n\n"
    "Pipeline: extract -> vocab -> train -> export -> eval.  `peagle demo` runs it all on a tiny target.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    """Import sub-command modules (each adds its commands to ``app``). Missing ones are skipped."""
    import importlib

    for name in ("extract", "store", "vocab", "train", "export", "eval", "demo"):
        try:
            importlib.import_module(f"peagle.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"peagle.cli.{name}":
                raise


def one_line(err: UserError) -> str:
    """The message of a UserError, also when a DataLoader worker raised it: torch re-raises those
    with the worker's traceback folded into the message, whose last line is the original one."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else type(err).__name__
    prefix = f"{UserError.__module__}.{UserError.__name__}: "
    return last[len(prefix):] if last.startswith(prefix) else last


def main(argv: list[str] | None = None) -> None:
    # rich lays --help out for 80 columns when stdout is not a terminal, which cuts long flag names
    # (`--down-sample-ra…`); give it room unless the user set a width.
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "120")
    _register()
    try:
        rc = app(args=argv, standalone_mode=False)
    except UserError as err:
        print(f"peagle: error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("peagle: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as err:
        sys.exit(err.exit_code)
    except typer.Abort:
        print("peagle: aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as err:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)
