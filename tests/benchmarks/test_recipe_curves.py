"""benchmarks/recipe_curves.py: every recipe is a `peagle train` command that parses, and a run of
some recipes keeps the others' records."""

from __future__ import annotations

import importlib

import pytest

from peagle.cli import _register, app

@pytest.fixture(scope="module")
def curves(load_benchmark):
    with load_benchmark("recipe_curves.py") as module:  # recipe_curves imports quality_variants
        yield module


def test_every_recipe_is_a_valid_train_command(curves, tmp_path) -> None:
    """Parsed by `peagle train` itself (which validates): its stores mixed, its steps, its flags."""
    _register()
    train = importlib.import_module("peagle.cli.train").COMMAND
    stores = {name: tmp_path / name for recipe in curves.RECIPES.values() for name in recipe.stores}
    assert {"small", "large", "sampled", "sampled2", "sampled3"} <= set(stores)
    for name, recipe in curves.RECIPES.items():
        args = curves.train_command(name, recipe, stores, target=tmp_path / "t", heldout=tmp_path / "h",
                                    work=tmp_path / "w")
        config = train.parse(app, args[1:])
        assert config.data.store == tuple(str(stores[s]) for s in recipe.stores), name
        assert config.max_steps == recipe.steps and config.data.eval_store == str(tmp_path / "h"), name
        assert config.out == str(tmp_path / "w" / name) and config.draft_vocab_size == curves.VOCAB, name
        assert (config.cod.max_anchors is None) == (config.method == "eagle3"), name  # P-EAGLE's cap only
    mixed = curves.RECIPES["4x-data+sampled"]
    assert mixed.stores == ("large", "sampled") and mixed.steps == curves.RECIPES["4x-data"].steps


def test_a_recipe_needs_its_stores(curves, tmp_path) -> None:
    with pytest.raises(SystemExit, match="needs --store sampled=DIR"):
        curves.train_command("4x-data+sampled", curves.RECIPES["4x-data+sampled"], {"large": tmp_path},
                             target=tmp_path, heldout=tmp_path, work=tmp_path)


def test_records_of_recipes_not_run_are_kept(curves) -> None:
    old = [{"recipe": "base", "v": 1}, {"recipe": "4x-data", "v": 1}]
    new = [{"recipe": "4x-data+sampled", "v": 2}, {"recipe": "base", "v": 2}]
    assert curves.merged_records(old, new) == [{"recipe": "base", "v": 2}, {"recipe": "4x-data", "v": 1},
                                               {"recipe": "4x-data+sampled", "v": 2}]
    assert curves.merged_records([], new) == new
