"""The eval report: JSON (no NaN), PNG plots, training curves from metrics.jsonl, summary table."""

from __future__ import annotations

import json

import pytest

from peagle.stages.eval.acceptance import AcceptanceHistogram
from peagle.stages.eval.report import build_report, read_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def section(counts: list[int]) -> dict:
    hist = AcceptanceHistogram(len(counts) - 1, list(counts))
    return hist.to_dict()


def sections() -> dict:
    return {"offline": section([10, 20, 30, 40]), "online": {**section([12, 18, 30, 40]), "speedup": 1.7},
            "vllm": section([12, 19, 29, 40])}


def write_metrics(run_dir):
    lines = [json.dumps({"kind": "train", "step": s, "loss": 5.0 / s, "depth_agreement": [0.5, 0.3, None],
                         "acceptance_length_estimate": 1.5}) for s in (10, 20, 30)]
    lines.append(json.dumps({"kind": "eval", "step": 30, "loss": 2.0, "depth_agreement": [0.4, 0.2, 0.1],
                             "acceptance_length_estimate": 1.4}))
    lines.append('{"kind": "train", "step": 40, "lo')  # a torn last line (killed writer) is skipped
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))


def test_report_json_and_plots(tmp_path):
    write_metrics(tmp_path / "run")
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [10, 20, 30, 30]
    report = build_report(sections={**sections(), "vllm": None}, meta={"num_depths": 3})
    written = write_report(tmp_path / "report", report, metrics=metrics)
    assert set(written) == {"report", "per_depth_acceptance", "acceptance_length", "training_curves"}
    for name, path in written.items():
        if name != "report":
            assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["vllm"] is None
    assert saved["plots"]["acceptance_length"] == "acceptance_length.png"
    assert saved["offline"]["acceptance_length_by_k"] == pytest.approx([1.9, 2.6, 3.0])
    assert not list((tmp_path / "report").glob(".*"))  # no temp files left


def test_nan_becomes_null_and_modes_are_compared(tmp_path):
    empty = AcceptanceHistogram(2).to_dict()  # no steps: NaN rates
    report = build_report(sections={**sections(), "offline": empty}, meta={})
    text = json.dumps(report, allow_nan=False)  # raises on NaN
    assert json.loads(text)["offline"]["acceptance_length"] is None
    gap = report["comparison"]["online_vs_vllm_relative_difference"]
    assert gap == pytest.approx(abs(report["online"]["acceptance_length"] - report["vllm"]["acceptance_length"])
                                / report["vllm"]["acceptance_length"])
    written = write_report(tmp_path, report)  # no metrics: no training curves
    assert "training_curves" not in written


def test_summary_table_reads_the_report():
    from peagle.stages.eval.report import summary_table

    report = build_report(sections=sections(), meta={})
    table = summary_table(report)
    assert "offline" in table and "vllm" in table and "% apart" in table
    assert f"{report['online']['acceptance_length']:.3f}" in table


def test_a_live_server_is_reported_and_compared_with_both_references(tmp_path):
    from peagle.stages.eval.report import summary_table

    served = {**section([11, 20, 29, 40]), "spec_tokens_per_second": 812.5, "tokens_per_target_forward": 2.9,
              "greedy_output_matches_target": True, "drafting": {"verdict": "consistent with parallel drafting"}}
    report = build_report(sections={**sections(), "server": served}, meta={})
    for reference in ("online", "vllm"):
        gap = report["comparison"][f"server_vs_{reference}_relative_difference"]
        assert gap == pytest.approx(abs(served["acceptance_length"] - report[reference]["acceptance_length"])
                                    / report[reference]["acceptance_length"])
    table = summary_table(report)
    assert "server vs own loop acceptance length" in table and "server vs vLLM acceptance length" in table
    assert "812.5 generated tokens/s" in table and "consistent with parallel drafting" in table
    assert "server: greedy output equals the target's own: True" in table
    assert write_report(tmp_path, report)["per_depth_acceptance"].is_file()


@pytest.mark.parametrize("eager, named", [(True, "vLLM (eager engines)"), (False, "vLLM (compiled engines)")])
def test_the_summary_says_whether_vllm_ran_eager_or_compiled(eager, named):
    """A speedup against an eager target and one against a compiled target differ by ~1.4x on CPU:
    the summary names which engines its vLLM figures come from."""
    from peagle.stages.eval.report import summary_table

    vllm = {**section([12, 19, 29, 40]), "tokens_per_target_forward": 1.7, "settings": {"enforce_eager": eager}}
    assert named in summary_table(build_report(sections={**sections(), "vllm": vllm}, meta={}))
