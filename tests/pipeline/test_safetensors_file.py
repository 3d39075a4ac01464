"""The safetensors header written and parsed here (pipeline/safetensors_file.py) is the library's own
format: files we write load with ``safetensors``, files it writes map here without being read."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle.pipeline.safetensors_file import encode_header, map_tensors, read_header


def test_our_header_loads_with_safetensors_and_maps_back(tmp_path):
    layout = {"a": ((7, 3, 16), torch.bfloat16), "b": ((7, 4), torch.int32), "c": ((7, 4), torch.float16)}
    tensors = {name: torch.arange(torch.Size(shape).numel()).to(dtype).view(shape)
               for name, (shape, dtype) in layout.items()}
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        f.write(encode_header(layout))
        for t in tensors.values():
            f.write(t.view(torch.uint8).numpy().tobytes())
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0
    loaded = load_file(str(path))
    header = read_header(path)
    assert header["a"].row_bytes == 3 * 16 * 2 and header["b"].shape == (7, 4)
    mapped = map_tensors(path)
    for name, t in tensors.items():
        assert loaded[name].dtype == mapped[name].dtype == t.dtype
        assert torch.equal(loaded[name], t) and torch.equal(mapped[name], t)


def test_files_written_by_safetensors_map_without_a_read(tmp_path):
    path = tmp_path / "y.safetensors"
    tensors = {"x": torch.randn(5, 2), "empty": torch.zeros(0, 3, dtype=torch.bfloat16)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    mapped = map_tensors(path)
    assert torch.equal(mapped["x"], tensors["x"]) and mapped["empty"].shape == (0, 3)


def test_a_header_that_does_not_fit_its_file_is_a_value_error(tmp_path):
    path = tmp_path / "z.safetensors"
    path.write_bytes(b"\xff" * 64)  # a header length far past the file's end
    with pytest.raises(ValueError, match="exceeds"):
        read_header(path)
    save_file({"x": torch.zeros(100)}, str(path))
    path.write_bytes(path.read_bytes()[:-8])  # the data cut short
    with pytest.raises(ValueError, match="past the file"):
        read_header(path)
