"""scripts/reliability_report.py: renders the suite's summary and rewrites only the README section
between its markers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reliability_report.py"


def _load():
    spec = importlib.util.spec_from_file_location("reliability_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUMMARY = {
    "python": "3.11", "torch": "2.x", "machine": "x86_64, 2 cores", "wall_s": 123.4, "tests_passed": 2,
    "tests_failed": 1, "tests_skipped": 1, "bad_records_catalogue": 259,
    "tests": [
        {"area": "extract", "test": "t1", "outcome": "passed", "trials": 20, "faults_injected": 26,
         "faults_survived": 26, "bad_inputs_tried": 0, "bad_inputs_handled": 0, "data_lost": 0, "notes": []},
        {"area": "bad inputs", "test": "t2", "outcome": "failed", "trials": 1, "faults_injected": 0,
         "faults_survived": 0, "bad_inputs_tried": 30, "bad_inputs_handled": 0, "data_lost": 0, "notes": ["deep"]},
        {"area": "disk full", "test": "t3", "outcome": "skipped", "trials": 1, "faults_injected": 1,
         "faults_survived": 0, "bad_inputs_tried": 0, "bad_inputs_handled": 0, "data_lost": 0, "notes": []},
        {"area": "bad inputs", "test": "t4", "outcome": "passed", "trials": 1, "faults_injected": 0,
         "faults_survived": 0, "bad_inputs_tried": 229, "bad_inputs_handled": 229, "data_lost": 0, "notes": []},
    ],
}

README = ("# peagle\n\nintro\n\n## Reliability\n\n<!-- reliability:begin -->\nold text\n<!-- reliability:end -->\n\n"
          "## After\nkept\n")


def test_rewrites_only_the_marked_section(tmp_path):
    report = _load()
    summary, readme = tmp_path / "s.json", tmp_path / "README.md"
    summary.write_text(json.dumps(SUMMARY))
    readme.write_text(README)
    assert report.main([str(summary), "--readme", str(readme)]) == 0
    text = readme.read_text()
    before, rest = text.split("<!-- reliability:begin -->")
    inside, after = rest.split("<!-- reliability:end -->")
    assert before == README.split("<!-- reliability:begin -->")[0]
    assert after == README.split("<!-- reliability:end -->")[1]
    assert "old text" not in inside
    assert "| **total** | 2/3 | 22 | 26 | 26 | 259 | 229 | 0 |" in inside  # the skipped test is left out
    assert "`t2` (bad inputs): deep" in inside
    assert report.main([str(summary), "--readme", str(readme), "--check"]) == 0
    readme.write_text(README)
    assert report.main([str(summary), "--readme", str(readme), "--check"]) == 1


@pytest.mark.parametrize("bad", ["no markers\n", "<!-- reliability:end -->\n<!-- reliability:begin -->\n",
                                 "<!-- reliability:begin -->\n<!-- reliability:begin -->\n<!-- reliability:end -->\n"])
def test_refuses_a_readme_without_one_pair_of_markers(tmp_path, bad):
    report = _load()
    summary, readme = tmp_path / "s.json", tmp_path / "README.md"
    summary.write_text(json.dumps(SUMMARY))
    readme.write_text(bad)
    with pytest.raises(SystemExit, match="reliability_report"):
        report.main([str(summary), "--readme", str(readme)])
    assert readme.read_text() == bad
