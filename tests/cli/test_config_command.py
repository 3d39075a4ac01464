"""Sub-commands generated from their schema configs (cli/config_command.py): every field is a flag with
its docstring as help and its default written once, the types become the right flags, and every
example config file parses against its command's config."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import typer.main

from peagle.cli import _register, app
from peagle.schemas.components import leaves
from peagle.schemas.errors import UserError
from peagle.schemas.fields import field_docs

COMMANDS = ("extract", "train", "export", "eval")
"""The commands with an example config file (examples/llama-3.1-8b/)."""
GENERATED = (*COMMANDS, "demo", "prompts")
EXAMPLES = Path(__file__).parents[2] / "examples" / "llama-3.1-8b"


def spec(name: str):
    _register()
    return importlib.import_module(f"peagle.cli.{name}").COMMAND


@pytest.mark.parametrize("name", GENERATED)
def test_every_config_field_is_a_flag_with_its_docstring_and_default(name):
    command_spec = spec(name)
    cls = command_spec.config_class
    command = typer.main.get_command(app).commands[name]
    params = {p.name: p for p in command.params}
    fields = {leaf.name: leaf.field for leaf in leaves(cls)}  # a part's fields (TrainConfig.optim) are flags too
    owner = {leaf.name: leaf.owner for leaf in leaves(cls)}
    extra = {"config"} | ({command_spec.more_name} if command_spec.more_values else set())
    assert set(params) == set(fields) | extra
    for field_name, f in fields.items():
        param = params[field_name]
        assert param.help == field_docs(owner[field_name])[field_name]
        if field_name in command_spec.arguments:
            assert param.param_type_name == "argument"
        else:
            assert param.opts[0] == "--" + field_name.replace("_", "-")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        assert param.required == (required and field_name != command_spec.more_values), field_name


@pytest.mark.parametrize("name, argv", [
    ("train", ["--store", "s", "--target", "t", "--out", "o"]),
    ("extract", ["--data", "d", "--target", "t", "--out", "o"]),
    ("export", ["r", "--out", "o"]),
    ("eval", ["r"]),
    ("demo", []),
    ("prompts", ["--target", "t", "--out", "no-such-dir/p.jsonl"]),
])
def test_unset_flags_take_the_config_defaults(name, argv):
    config = spec(name).parse(app, argv)
    for leaf in leaves(type(config)):
        if leaf.field.default is not dataclasses.MISSING:
            value = getattr(getattr(config, leaf.part) if leaf.part else config, leaf.name)
            assert value == leaf.field.default, leaf.name


def test_tuple_fields_are_repeatable_comma_lists_or_take_trailing_values():
    train = spec("train").parse(app, ["--store", "a", "--store", "b:0.5", "--target", "t", "--out", "o", "--fsdp",
                                        "--optimizer", "adamw"])
    assert train.data.store == ("a", "b:0.5") and train.fsdp is True
    extract = spec("extract").parse(app, ["--data", "a.jsonl", "b.jsonl", "c.parquet", "--target", "t", "--out", "o",
                                          "--aux-layers", "2, 8,13"])
    assert extract.data == ("a.jsonl", "b.jsonl", "c.parquet") and extract.aux_layers == (2, 8, 13)
    evaluation = spec("eval").parse(app, ["run", "--mode", "offline,vllm", "--quiet", "--num-depths", "3"])
    assert evaluation.mode == ("offline", "vllm") and evaluation.quiet and evaluation.num_depths == 3
    with pytest.raises(UserError, match="--aux-layers must be comma-separated integers"):
        spec("extract").parse(app, ["--data", "a", "--target", "t", "--out", "o", "--aux-layers", "2,x"])
    with pytest.raises(UserError, match="--mode takes a comma list"):
        spec("eval").parse(app, ["run", "--mode", "offline,nope"])


@pytest.mark.parametrize("name", COMMANDS)
def test_the_llama_3_1_8b_example_parses_and_opens_with_its_command(name):
    path = EXAMPLES / f"{name}.yaml"
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and f"peagle {name} --config examples/llama-3.1-8b/{name}.yaml" in first
    config = spec(name).parse(app, ["--config", str(path)])
    assert isinstance(config, spec(name).config_class)
    assert "Llama-3.1-8B" in str(config)
