"""The `peagle` command as a whole, through the real console script: every kind of usage error of every
sub-command is one line on stderr with exit code 2, `--version`, help text shown as written, and
what `--verbose` changes.

The cases are generated from the registered commands (a new sub-command is covered without editing
this file) and read the parameters' Python annotations, not click's objects: typer 0.29 runs on its
own vendored click, whose parameters look different from click's.
"""

from __future__ import annotations

import enum
import inspect
import os
import re
import typing
from importlib import metadata
from typing import Any

import pytest
import typer.main

from peagle.cli import _register, app, main
from peagle.cli.quiet import QUIET_ENVIRONMENT, QUIET_WARNINGS, quiet_libraries

_register()
ROOT = typer.main.get_command(app)


def _walk(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path, command) of the root, every group and every leaf command."""
    out = [(path, command)]
    for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
        out += _walk(sub, (*path, name))
    return out


COMMANDS = _walk(ROOT)
GROUPS = [(p, c) for p, c in COMMANDS if getattr(c, "commands", None)]
LEAVES = [(p, c) for p, c in COMMANDS if not getattr(c, "commands", None)]


def _hints(command: Any) -> dict[str, Any]:
    """The callback's parameter types (``Optional[X]`` -> ``X``)."""
    fn = inspect.unwrap(command.callback)
    hints = typing.get_type_hints(fn)
    return {name: next((a for a in typing.get_args(h) if a is not type(None)), h)
            if typing.get_origin(h) is typing.Union else h for name, h in hints.items()}


def _kind(hint: Any) -> str | None:
    if inspect.isclass(hint) and issubclass(hint, enum.Enum):
        return "choice"
    if hint is int or hint is float:
        return "number"
    return None


def _filler(param: Any, hints: dict[str, Any]) -> str:
    """A value the parser accepts for a required parameter (the command never runs in these cases)."""
    return "1" if _kind(hints.get(param.name)) == "number" else "x"


def _required_except(command: Any, hints: dict[str, Any], missing: Any) -> list[str]:
    """Arguments giving every required parameter but ``missing`` (positionals only when none is missing)."""
    args: list[str] = []
    for param in command.params:
        if not param.required or param is missing:
            continue
        if param.param_type_name == "argument":
            if missing is None or missing.param_type_name != "argument":
                args.append(_filler(param, hints))
        else:
            args += [param.opts[0], _filler(param, hints)]
    return args


def _cases() -> list[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """(kind, command path, arguments, needles) for every usage error that applies to each command."""
    cases = []
    for path, _ in GROUPS:
        cases.append(("unknown command", path, ("no-such-command",), ("No such command", "no-such-command")))
    for path, command in LEAVES:
        hints = _hints(command)
        cases.append(("unknown option", path, ("--no-such-flag",), ("No such option", "--no-such-flag")))
        for param in command.params:
            if param.required and param.param_type_name == "argument":
                cases.append(("missing argument", path, tuple(_required_except(command, hints, param)),
                              ("Missing argument", param.name)))
            elif param.required:
                cases.append(("missing option", path, tuple(_required_except(command, hints, param)),
                              ("Missing option", param.opts[0])))
        options = [p for p in command.params if p.param_type_name == "option"]
        number = next((p for p in options if _kind(hints.get(p.name)) == "number"), None)
        if number is not None:  # bad values come before required ones: they are converted first
            cases.append(("bad type", path, (number.opts[0], "abc"), ("Invalid value", number.opts[0])))
        for param in options:
            if _kind(hints.get(param.name)) == "choice":
                cases.append(("bad choice", path, (param.opts[0], "no-such-choice"),
                              ("Invalid value", param.opts[0], "no-such-choice")))
    return cases


CASES = _cases()


def test_every_kind_of_usage_error_is_exercised_on_this_app():
    """The generated cases cover each kind somewhere, and every leaf command has at least one."""
    kinds = {kind for kind, *_ in CASES}
    assert kinds == {"unknown command", "unknown option", "missing argument", "missing option", "bad type",
                     "bad choice"}
    assert {path for _, path, *_ in CASES} >= {path for path, _ in LEAVES}
    assert len(LEAVES) >= 8  # extract, store info/verify, vocab, train, export, eval, demo


def _one_line_usage_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("peagle: error: "), proc.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    return lines[0]


@pytest.mark.parametrize("kind,path,args,needles", CASES,
                         ids=[f"{' '.join(c[1]) or 'peagle'}: {c[0]} {c[3][-1]}" for c in CASES])
def test_usage_error_is_one_line_with_exit_code_2(kind, path, args, needles, run_peagle):
    line = _one_line_usage_error(run_peagle(*path, *args), *needles)
    assert line.endswith(f"See `{' '.join(('peagle', *path))} --help`.")


@pytest.mark.parametrize("path,group", GROUPS, ids=[" ".join(("peagle", *p)) for p, _ in GROUPS])
def test_a_bare_group_prints_its_help(path, group, run_peagle):
    proc = run_peagle(*path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert f"Usage: {' '.join(('peagle', *path))} " in proc.stdout
    assert all(re.search(rf"^\W*{name}\s", proc.stdout, re.MULTILINE) for name in group.commands), proc.stdout


@pytest.mark.parametrize("args,usage", [(("demo", "--verbose"), "peagle --verbose demo ..."),
                                        (("store", "info", "--version"), "peagle --version")])
def test_a_root_option_after_the_sub_command_says_where_it_goes(args, usage, run_peagle):
    line = _one_line_usage_error(run_peagle(*args), "before any sub-command")
    assert line.endswith(usage)


def test_version_names_peagle_and_its_main_libraries(run_peagle):
    proc = run_peagle("--version")
    assert proc.returncode == 0 and proc.stderr == ""
    line, = proc.stdout.splitlines()
    assert line.startswith(f"peagle {metadata.version('peagle')} (Python ")
    assert f"torch {metadata.version('torch')}" in line and f"transformers {metadata.version('transformers')}" in line


def _help_texts(command: Any) -> list[str]:
    return [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(("peagle", *p)) for p, _ in COMMANDS])
def test_help_shows_every_docstring_as_written(path, command, run_peagle):
    """Nothing of a docstring is swallowed: rich markup once ate "[embeddings, fc(aux)]" from
    `peagle train --help`. Every bracketed piece and every word of each help text appear."""
    proc = run_peagle(*path, "--help")
    assert proc.returncode == 0, proc.stderr
    shown = " ".join(proc.stdout.split())
    shown += " " + re.sub(r"(\w)- (\w)", r"\1-\2", shown)  # a line wrapped after a hyphen is not swallowed text
    for text in _help_texts(command):
        text = text.replace("\b", "")
        for bracketed in re.findall(r"\[[^\]]*\]", text):
            assert " ".join(bracketed.split()) in shown, f"{bracketed!r} missing from `peagle {' '.join(path)} --help`"
        for word in text.split():
            assert word in shown, f"{word!r} missing from `peagle {' '.join(path)} --help`"


def test_some_help_text_has_brackets():
    """The help test above is not vacuous: the app's docstrings do contain bracketed text."""
    assert any("[" in t for _, c in COMMANDS for t in _help_texts(c))


def test_quiet_libraries_sets_what_the_user_did_not():
    environ = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    quiet_libraries(environ)
    assert environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert {k: environ[k] for k in QUIET_ENVIRONMENT if k != "VLLM_LOGGING_LEVEL"} == \
        {k: v for k, v in QUIET_ENVIRONMENT.items() if k != "VLLM_LOGGING_LEVEL"}
    assert environ["PYTHONWARNINGS"] == ",".join(QUIET_WARNINGS)


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_decides_whether_the_command_quiets_its_libraries(verbose, monkeypatch, tmp_path, capsys):
    """In the command's own process: without --verbose the quiet settings are in the environment the
    stages (and vLLM's engine processes) see; with it, nothing is changed."""
    owned = set(QUIET_ENVIRONMENT) | {"PYTHONWARNINGS", "PEAGLE_VERBOSE"}
    environ = {k: v for k, v in os.environ.items() if k not in owned}
    monkeypatch.setattr(os, "environ", environ)
    with pytest.raises(SystemExit) as exit_info:
        main([*(["--verbose"] if verbose else []), "store", "info", "--store", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith("peagle: error: ")
    assert all((k in environ) != verbose for k in QUIET_ENVIRONMENT)
