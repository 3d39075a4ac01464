"""A model directory's weights as one file or as shards and their index (pipeline/weight_files.py):
both forms read back the same tensors, and an index from elsewhere is data, not a path to follow."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from peagle.pipeline.contained import REFUSED
from peagle.pipeline.weight_files import (WEIGHTS_FILE, WEIGHTS_INDEX_FILE, iter_tensors, load_tensors, save_tensors,
                                          weight_file_names, weight_map)
from peagle.schemas.errors import UserError


def tensors_of(sizes: list[int]) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.arange(n, dtype=torch.float32) + i for i, n in enumerate(sizes)}


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=8), cap=st.integers(4, 300))
def test_shards_hold_every_tensor_once_and_none_is_over_the_cap_unless_alone(tmp_path_factory, sizes, cap):
    root = tmp_path_factory.mktemp("w")
    tensors = tensors_of(sizes)
    written = save_tensors(tensors, root, max_file_bytes=cap)
    back = load_tensors(root)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    if sum(4 * n for n in sizes) <= cap:
        assert written == [WEIGHTS_FILE]
        return
    assert written[-1] == WEIGHTS_INDEX_FILE and not (root / WEIGHTS_FILE).exists()
    index = json.loads((root / WEIGHTS_INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(4 * n for n in sizes)
    for name in weight_file_names(root):
        held = [k for k, f in index["weight_map"].items() if f == name]
        assert len(held) == 1 or sum(tensors[k].numel() * 4 for k in held) <= cap, name


def test_one_file_and_shards_read_the_same(tmp_path):
    tensors = tensors_of([10, 20, 30])
    save_tensors(tensors, (tmp_path / "one").mkdir() or tmp_path / "one")
    save_tensors(tensors, (tmp_path / "shards").mkdir() or tmp_path / "shards", max_file_bytes=100)
    assert weight_file_names(tmp_path / "one") == [WEIGHTS_FILE]
    assert weight_file_names(tmp_path / "shards") == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    one, shards = (dict(iter_tensors(tmp_path / d)) for d in ("one", "shards"))
    assert one.keys() == shards.keys() and all(torch.equal(one[k], shards[k]) for k in one)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "link.safetensors"])
def test_an_index_naming_a_file_outside_its_directory_is_refused_before_a_read(tmp_path, name):
    root, outside = tmp_path / "model", tmp_path / "outside.safetensors"
    root.mkdir()
    save_file({"a": torch.zeros(2)}, str(outside))
    (root / "link.safetensors").symlink_to(outside)
    (root / WEIGHTS_INDEX_FILE).write_text(json.dumps({"weight_map": {"a": name}}))
    with pytest.raises(UserError, match="weight_map") as err:
        load_tensors(root)
    assert REFUSED in str(err.value) and "\n" not in str(err.value)


def test_an_index_that_does_not_describe_its_shards_is_one_line(tmp_path):
    save_tensors(tensors_of([8, 8, 8]), tmp_path, max_file_bytes=40)
    index = json.loads((tmp_path / WEIGHTS_INDEX_FILE).read_text())
    moved = {**index["weight_map"], "t0": index["weight_map"]["t1"]}  # t0 said to be where t1 is
    (tmp_path / WEIGHTS_INDEX_FILE).write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(UserError, match="does not hold what"):
        load_tensors(tmp_path)
    (tmp_path / WEIGHTS_INDEX_FILE).write_text(json.dumps({"weight_map": {**index["weight_map"], "t9": "gone.safetensors"}}))
    with pytest.raises(UserError, match="names gone.safetensors, which is not in"):
        weight_map(tmp_path)
    (tmp_path / WEIGHTS_INDEX_FILE).write_text("[1, 2")
    with pytest.raises(UserError, match=f"cannot read .*{WEIGHTS_INDEX_FILE}"):
        weight_map(tmp_path)
