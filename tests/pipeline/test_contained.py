"""The one rule for names a file gives (pipeline/contained.py): a name with ``..`` or an absolute one is
refused, whatever else it holds; a clean relative name is joined to its root and stays under it; a
symbolic link out of the tree is refused, one that stays in is not; sha256s and shard indices have
their shape. Every refusal is one line naming the file and the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peagle.pipeline.contained import (REFUSED, checked_index, checked_sha256, contained, escape_problem, inside,
                                       name_problem)
from peagle.schemas.errors import UserError

# A path component peagle could be handed: any characters but "/" and NUL, never "." or ".." alone.
COMPONENT = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1,
                    max_size=12).filter(lambda c: c not in (".", ".."))
CLEAN = st.lists(COMPONENT, min_size=1, max_size=5).map("/".join)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tree with nothing in it but what a test makes (the module's tests only read it)."""
    return tmp_path_factory.mktemp("tree") / "store"


def refusal(root: Path, name: object) -> str:
    with pytest.raises(UserError) as err:
        contained(root, name, named_by="commit record X.json", field="parquet")
    line = str(err.value)
    assert "\n" not in line and line.startswith("commit record X.json: parquet ") and line.endswith(REFUSED)
    return line


@given(before=st.lists(COMPONENT, max_size=3), after=st.lists(COMPONENT, max_size=3), ups=st.integers(1, 3))
def test_any_name_with_a_dotdot_component_is_refused(root, before, after, ups):
    name = "/".join([*before, *[".."] * ups, *after])
    assert name_problem(name) == "has a '..' component"
    assert "'..'" in refusal(root, name)


@given(name=CLEAN)
def test_any_absolute_name_is_refused(root, name):
    assert name_problem("/" + name) == "is an absolute path"
    refusal(root, "/" + name)
    refusal(root, str(root / name))  # even one that points inside the tree: names are relative


@given(name=CLEAN)
def test_a_clean_relative_name_is_accepted_and_stays_inside(root, name):
    path = contained(root, name, named_by="commit record X.json", field="parquet")
    assert path == root / name
    assert path.resolve().is_relative_to(root.resolve()) and path.resolve() != root.resolve()


@pytest.mark.parametrize("name", ["", ".", "./", "a\0b", 3, None, ["shards/x"]])
def test_names_that_name_nothing_or_are_no_string_are_refused(root, name):
    refusal(root, name)


def test_a_link_out_of_the_tree_is_refused_and_one_inside_is_not(tmp_path):
    root, outside = tmp_path / "store", tmp_path / "elsewhere"
    (root / "shards").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim").write_text("x")
    (root / "shards" / "real").write_text("x")
    (root / "shards" / "out").symlink_to(outside / "victim")
    (root / "shards" / "in").symlink_to(root / "shards" / "real")
    (root / "linked").symlink_to(outside, target_is_directory=True)
    (root / "loop").symlink_to(root / "loop")
    (root / "up").symlink_to(root, target_is_directory=True)
    assert "symbolic link to " + str(outside / "victim") in refusal(root, "shards/out")
    assert "symbolic link" in refusal(root, "linked/victim")
    assert "symbolic link" in refusal(root, "linked/not-there-yet")  # a file about to be written through it
    assert "cannot be resolved" in refusal(root, "loop/x")
    assert "the tree itself" in refusal(root, "up")
    assert contained(root, "shards/in", named_by="r", field="f") == root / "shards" / "in"
    assert contained(root, "up/shards/real", named_by="r", field="f") == root / "up" / "shards" / "real"
    assert contained(root, "shards/new", named_by="r", field="f") == root / "shards" / "new"
    # The root may itself be a link (a store on another disk): names are judged against where it leads.
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    assert contained(alias, "shards/real", named_by="r", field="f") == alias / "shards" / "real"
    assert escape_problem(alias, alias / "shards" / "out") is not None


def test_inside_names_the_tree_and_the_path(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(UserError, match=rf"^run {tmp_path / 'run'}: path 'checkpoints' leads through a symbolic link"):
        inside(tmp_path / "run", "checkpoints", tree="run")


@given(value=st.text(max_size=70) | st.integers() | st.none())
def test_only_a_sha256_may_name_a_registration(value):
    ok = isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    if ok:
        assert checked_sha256(value, named_by="input registration R.json") == value
    else:
        with pytest.raises(UserError, match=r"^input registration R\.json: sha256 .* is not a sha256"):
            checked_sha256(value, named_by="input registration R.json")


def test_sha256_shapes():
    assert checked_sha256("0123456789abcdef" * 4, named_by="r") == "0123456789abcdef" * 4
    for bad in ("../../victim", "A" * 64, "0" * 63, "0" * 65, "0" * 63 + "\n", "0" * 64 + "/x"):
        with pytest.raises(UserError, match=REFUSED):
            checked_sha256(bad, named_by="r")


@given(value=st.integers(0, 10**9))
def test_a_whole_number_is_a_shard_index(value):
    assert checked_index(value, named_by="r", field="index") == value


@pytest.mark.parametrize("value", [-1, True, 1.0, "3", "../3", None])
def test_anything_else_is_no_shard_index(value):
    with pytest.raises(UserError, match=r"^r: index .* is not a shard index"):
        checked_index(value, named_by="r", field="index")


def test_nothing_is_created_by_judging_a_name(tmp_path):
    contained(tmp_path, "a/b/c", named_by="r", field="f")
    with pytest.raises(UserError):
        contained(tmp_path, "../x", named_by="r", field="f")
    assert os.listdir(tmp_path) == []
