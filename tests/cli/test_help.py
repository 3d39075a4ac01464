"""Help that tells the truth, the same way in every command (issue 22): every example command in a help text
runs; every value is written as one style of placeholder; `--out` naming a file is one line in every verb
that has one. The commands are found from the registered app, so a new verb or example is covered."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from peagle.cli import _register, app, main

_register()


def _leaves(command, path=()):
    subs = getattr(command, "commands", None) or {}
    if not subs:
        return [(path, command)]
    return [leaf for name, sub in sorted(subs.items()) for leaf in _leaves(sub, (*path, name))]


LEAVES = _leaves(typer.main.get_command(app))
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\[:[A-Z]+\])?$|^[a-z0-9_]+([|,][a-z0-9_]+)+$")
"""``STORE``, ``N``, ``STORE[:WEIGHT]``, or the choices ``bf16|fp8`` / ``offline,online,vllm``."""


def _help(path: tuple[str, ...], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("path,command", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_value_is_one_style_of_placeholder(path, command, capsys):
    for param in command.params:
        if param.param_type_name == "option" and not param.is_flag and not param.hidden:
            assert param.metavar and PLACEHOLDER.match(param.metavar), (param.name, param.metavar)
    text = _help(path, capsys)
    assert not re.search(r"<(int|str|float|path|bool|text|list)", text), text
    assert "{" not in text.split("\n\n")[0], text  # the usage line: `SOURCE`, not `{SOURCE}`


OUT_VERBS = {
    ("extract",): ("--data", "x.jsonl", "--target", "t"),
    ("train",): ("--store", "s", "--target", "t"),
    ("export",): ("run",),
    ("eval",): ("export",),
    ("store", "convert"): ("--store", "s", "--hidden-dtype", "fp8"),
    ("demo",): (),
}


OUT_FILE_VERBS = {
    ("prompts",): ("--target", "t"),
}
"""Verbs whose --out names a file to write, not a directory: an existing one is refused, never written over."""


def test_the_out_cases_cover_every_verb_with_an_out_option():
    assert {path for path, command in LEAVES if any("--out" in p.opts for p in command.params)} == \
        set(OUT_VERBS) | set(OUT_FILE_VERBS)


@pytest.mark.parametrize("path", OUT_VERBS, ids=[" ".join(p) for p in OUT_VERBS])
def test_out_naming_an_existing_file_is_one_line_in_every_verb(path, tmp_path, run_peagle):
    existing = tmp_path / "a-file"
    existing.write_text("not a directory\n")
    proc = run_peagle(*path, *OUT_VERBS[path], "--out", existing, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"peagle: error: --out {existing} is a file; --out names a directory (a new one, "
                                   "or one this command wrote before)")
    assert existing.read_text() == "not a directory\n"


@pytest.mark.parametrize("path", OUT_FILE_VERBS, ids=[" ".join(p) for p in OUT_FILE_VERBS])
def test_out_naming_an_existing_file_or_a_directory_is_one_line_where_out_is_a_file(path, tmp_path, run_peagle):
    existing = tmp_path / "a-file"
    existing.write_text("earlier output\n")
    proc = run_peagle(*path, *OUT_FILE_VERBS[path], "--out", existing, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"peagle: error: --out {existing} exists; remove it or name another file"
    assert existing.read_text() == "earlier output\n"
    proc = run_peagle(*path, *OUT_FILE_VERBS[path], "--out", tmp_path, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (f"peagle: error: --out {tmp_path} is a directory; --out "
                                                            "names the JSONL file to write"), proc.stderr


# ------------------------------------------------------------------------------------------------------
# Every example command in a help text runs

EXAMPLES_NOT_RUN = {
    ("prompts",): "it needs a real chat model: a random tiny target writes no requests, and 20,000 prompts take "
                  "hours on a CPU (tests/stages/extract/test_prompts.py runs the command on a tiny target)",
}
"""Commands whose help examples are checked for placeholders but not run, and why."""


def examples() -> list[tuple[tuple[str, ...], str]]:
    """(command, example line) of every help text: its lines that start with `peagle ` or `torchrun `."""
    return [(path, line.strip()) for path, command in LEAVES for line in (command.help or "").splitlines()
            if line.strip().startswith(("peagle ", "torchrun "))]


def test_help_examples_are_found_and_use_the_console_script_runnably():
    found = [line for _, line in examples()]
    assert any(line.startswith("torchrun ") for line in found)
    for line in found:  # torchrun runs a file or a module: `-m peagle`, never a bare `peagle`
        assert not re.search(r"torchrun\b.*\s(?<!-m )peagle\s", line), line


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama) -> Path:
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.testing.chat_data import write_chat_jsonl

    root = tmp_path_factory.mktemp("help_examples")
    data = write_chat_jsonl(root / "chat.jsonl", 4, seed=7)  # 2 shards of 2: every train step is one small batch
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), backend="hf",
                              topk=8, samples_per_shard=2, device="cpu", max_seq_len=256),
                echo=lambda _: None, progress=False)
    return root / "store"


@pytest.mark.slow
def test_every_help_example_runs(store, tiny_llama, tmp_path, run_peagle):
    """Placeholders are filled with a tiny store, target and budget; anything else in them runs as written
    (`peagle ...` through the session's runner, `torchrun ...` as the console script)."""
    values = {"STORE": str(store), "MODEL_DIR": str(tiny_llama), "SIZE": "200", "STEPS": "1", "GPUS": "1"}
    ran = 0
    for i, (path, line) in enumerate(examples()):
        words = shlex.split(line)
        args = []
        for word in words[1:]:
            if word == "RUN_DIR":
                word = str(tmp_path / f"run{i}")
            elif re.fullmatch(r"[A-Z][A-Z_]*", word):
                assert word in values, f"`peagle {' '.join(path)} --help` example uses {word}, which this test " \
                                       f"does not fill: {line}"
                word = values[word]
            args.append(word)
        if path in EXAMPLES_NOT_RUN:
            continue
        if words[0] == "peagle":
            proc = run_peagle(*args, timeout=900)
        else:
            proc = subprocess.run([str(Path(sys.executable).with_name("torchrun")), *args], capture_output=True,
                                  text=True, timeout=900)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
        ran += 1
    assert ran >= 4
