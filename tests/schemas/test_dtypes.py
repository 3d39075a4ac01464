"""One dtype, every spelling (issue 22): `bf16` and `bfloat16` wherever a flag takes a dtype."""

from __future__ import annotations

import pytest

from peagle.schemas.dtypes import dtype_choice
from peagle.schemas.errors import UserError
from peagle.schemas.eval_config import EvalConfig
from peagle.schemas.export_config import ExportConfig
from peagle.schemas.extract_config import ExtractConfig
from peagle.schemas.store_config import ConvertConfig


def test_each_flag_takes_either_spelling_and_keeps_its_own():
    extract = ExtractConfig(data=("d.jsonl",), target="t", out="o", dtype="bf16", hidden_dtype="bfloat16",
                            logprob_dtype="fp32")
    assert (extract.dtype, extract.hidden_dtype, extract.logprob_dtype) == ("bfloat16", "bf16", "float32")
    assert ExtractConfig(data=("d.jsonl",), target="t", out="o", hidden_dtype="float8").hidden_dtype == "fp8"
    assert ExportConfig(source="r", out="o", dtype="bf16").dtype == "bfloat16"
    assert EvalConfig(source="r", target_dtype="bf16").target_dtype == "bfloat16"
    assert ConvertConfig(store="s", hidden_dtype="bfloat16", out="o").hidden_dtype == "bf16"


def test_a_dtype_the_flag_does_not_take_names_the_choices_in_both_spellings():
    with pytest.raises(UserError, match=r"--hidden-dtype must be one of bf16 \(bfloat16\), fp8 \(float8\), got 'fp16'"):
        dtype_choice("hidden-dtype", "fp16", ("bf16", "fp8"))
    with pytest.raises(UserError, match=r"--dtype must be one of auto, float32 \(fp32\), bfloat16 \(bf16\)"):
        ExtractConfig(data=("d.jsonl",), target="t", out="o", dtype="half")
