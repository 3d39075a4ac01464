"""ExtractConfig: the vLLM pass-through options are validated before any engine starts."""

from __future__ import annotations

import pytest

from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig

BASE = dict(data=("chats.jsonl",), target="model", out="store")


def test_vllm_engine_args_parse_to_a_dict():
    cfg = ExtractConfig(**BASE, tensor_parallel_size=2, gpu_memory_utilization=0.8,
                        vllm_engine_args='{"max_num_seqs": 64, "enforce_eager": true}')
    assert cfg.vllm_engine_kwargs() == {"max_num_seqs": 64, "enforce_eager": True}
    assert ExtractConfig(**BASE).vllm_engine_kwargs() == {}


@pytest.mark.parametrize("kw, words", [
    (dict(vllm_engine_args="{bad"), "not valid JSON"),
    (dict(vllm_engine_args="[1, 2]"), "must be a JSON object"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
])
def test_bad_vllm_options_are_one_line_errors(kw, words):
    with pytest.raises(UserError, match=words) as info:
        ExtractConfig(**BASE, **kw)
    assert "\n" not in str(info.value)
