"""The target content hash: equal for the same files anywhere, different for other weights of one shape."""

from __future__ import annotations

import shutil

from peagle.pipeline.target_identity import SAMPLE_BYTES, target_content_hash
from peagle.testing.tiny_target import TinyTargetSpec, build_tiny_target


def test_a_copy_hashes_equal_and_other_weights_of_the_same_shape_do_not(tiny_llama, tmp_path):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    assert target_content_hash(copy) == target_content_hash(tiny_llama)
    other = build_tiny_target(tmp_path / "other", TinyTargetSpec(arch="llama", seed=7))
    assert sorted((p.name, p.stat().st_size) for p in other.glob("*.safetensors")) == \
        sorted((p.name, p.stat().st_size) for p in tiny_llama.glob("*.safetensors"))  # names and sizes agree
    assert target_content_hash(other) != target_content_hash(tiny_llama)


def test_config_weights_and_small_files_count(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"tiny")  # shorter than one sample
    (tmp_path / "README.md").write_text("not a weight file")
    first = target_content_hash(tmp_path)
    (tmp_path / "README.md").write_text("changed")
    assert target_content_hash(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"tinY")
    assert target_content_hash(tmp_path) != first
    (tmp_path / "model.safetensors").write_bytes(bytes(3 * SAMPLE_BYTES))
    zeros = target_content_hash(tmp_path)
    data = bytearray(3 * SAMPLE_BYTES)
    data[-1] = 1  # the last sample ends at the last byte
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    assert target_content_hash(tmp_path) != zeros
    (tmp_path / "config.json").write_text('{"hidden_size": 9}')
    assert target_content_hash(tmp_path) not in (zeros, first)
