"""`peagle extract --backend vllm` through the real console script prints peagle's own lines only:
none of vLLM's INFO/WARNING lines (from its three processes), torch's warnings or vLLM's
weight-loading bar, and no carriage returns when the output is not a terminal."""

from __future__ import annotations

import importlib.util
import re

import pytest

from peagle.testing.chat_data import write_chat_jsonl

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed here")]


def test_vllm_extract_prints_only_peagles_lines(tiny_llama, tmp_path, run_peagle):
    data = write_chat_jsonl(tmp_path / "chats.jsonl", 6, seed=5)
    proc = run_peagle("extract", "--data", data, "--target", tiny_llama, "--out", tmp_path / "store",
                      "--backend", "vllm", "--samples-per-shard", "3", "--topk", "4", env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout.splitlines(), proc.stderr.splitlines()
    assert "\r" not in proc.stdout + proc.stderr
    assert out[0].startswith("peagle extract plan") and out[-1].startswith("committed 2 shards")
    assert all(line.startswith("  ") for line in out[1:-1]), proc.stdout  # the plan's own lines
    assert err and all(re.fullmatch(r"extract: \d+/6 rec \(\d+%\), .*", line) for line in err), proc.stderr
