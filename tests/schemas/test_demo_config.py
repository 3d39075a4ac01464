"""`DemoConfig` checks its values also when built from Python (the CLI's parser checks the choices
first; tests/cli/test_demo.py covers the flags)."""

from __future__ import annotations

import pytest

from peagle.schemas.demo_config import DemoConfig
from peagle.schemas.errors import UserError


def test_the_defaults_are_valid_and_a_dtype_is_written_the_way_the_store_writes_it():
    assert DemoConfig().target == "smollm2"
    assert DemoConfig(hidden_dtype="float8").hidden_dtype == "fp8"


@pytest.mark.parametrize("values,needle", [
    ({"target": "nope"}, "--target must be one of smollm2|tiny, got 'nope'"),
    ({"backend": "onnx"}, "--backend must be one of auto|vllm|hf, got 'onnx'"),
    ({"eval_modes": ()}, "--eval-modes takes a comma list of offline,online,vllm, got ''"),
    ({"num_heldout": 0}, "--num-heldout must be >= 1, got 0"),
    ({"target_steps": 0}, "--target-steps must be >= 1, got 0"),
])
def test_a_bad_value_is_one_line_naming_the_flag(values, needle):
    with pytest.raises(UserError) as err:
        DemoConfig(**values)
    assert str(err.value) == needle
