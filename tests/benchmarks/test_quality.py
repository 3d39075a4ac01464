"""benchmarks/quality.py: the variant table, the statistics, and a --smoke run through the real CLI."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.cli import _register, app
from peagle.schemas.components import leaves
from peagle.schemas.train_config import TrainConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"


@pytest.fixture(scope="module")
def bench(load_benchmark):
    with load_benchmark("quality.py") as module:  # quality imports quality_variants, its neighbour
        yield module


def test_every_variant_flag_is_a_train_flag(bench) -> None:
    fields = {leaf.name for leaf in leaves(TrainConfig)}  # the flags, each part's included
    flags = set(bench.BASE_TRAIN) | {flag for variant in bench.VARIANTS.values() for flag in variant}
    assert {flag[2:].replace("-", "_") for flag in flags} <= fields
    assert set(bench.DEFAULT_VARIANTS) | set(bench.TOY_VARIANTS) <= set(bench.VARIANTS) and bench.VARIANTS["baseline"] == {}
    assert set(bench.REFERENCE) | set(bench.REFERENCE.values()) <= set(bench.VARIANTS)


@pytest.mark.parametrize("budget", ["Budget", "TOY", "SMOKE"])
def test_every_variant_is_a_valid_train_command(bench, budget) -> None:
    """Each run's whole flag list, parsed by `peagle train` itself into its config (which validates it):
    a variant that `peagle train` would refuse fails here, not hours into the benchmark."""
    _register()
    train = importlib.import_module("peagle.cli.train").COMMAND
    budget = getattr(bench, budget)() if budget == "Budget" else getattr(bench, budget)
    for variant in bench.VARIANTS:
        config = train.parse(app, ["--store", "s", "--target", "t", "--out", "o",
                                   *bench.train_flags(variant, budget, seed=1)])
        assert config.method == bench.method_of(variant) and config.seed == 1, variant
        assert config.max_steps == budget.train_steps and config.data.token_budget == budget.token_budget, variant


def test_eagle3_variants_train_the_other_method_on_the_same_budget(bench) -> None:
    budget = bench.Budget()
    assert budget.max_anchors is not None  # the P-EAGLE runs' cap, which EAGLE-3 does not take
    for variant, reference, k in (("eagle3-k3", "defaults-k3", "3"), ("eagle3-k5", "muon-all-norms", "5")):
        assert variant in bench.DEFAULT_VARIANTS and bench.REFERENCE[variant] == reference
        flags, theirs = bench.train_flags(variant, budget, seed=0), bench.train_flags(reference, budget, seed=0)
        assert flags[flags.index("--method") + 1] == "eagle3" and "--method" not in theirs
        assert flags[flags.index("--num-depths") + 1] == theirs[theirs.index("--num-depths") + 1] == k
        dropped = {"--max-anchors", "--down-sample-ratio", "--down-sample-ratio-min"}
        assert dropped <= set(theirs) and not dropped & set(flags)
        # Everything else (budget, optimizer, norms, seed) is the P-EAGLE run's.
        assert [f for f in theirs if f.startswith("--") and f not in dropped] == [
            f for f in flags if f.startswith("--") and f != "--method"]
        for flag in ("--max-steps", "--token-budget", "--draft-vocab-size", "--optimizer", "--lr", "--seed"):
            assert flags[flags.index(flag) + 1] == theirs[theirs.index(flag) + 1]


def test_train_flags_replace_base_values(bench) -> None:
    budget = bench.Budget()
    base = bench.train_flags("baseline", budget, seed=2)
    k3 = bench.train_flags("k3", budget, seed=2)
    assert base[base.index("--num-depths") + 1] == "5" and k3[k3.index("--num-depths") + 1] == "3"
    assert k3.count("--num-depths") == 1 and base[base.index("--seed") + 1] == "2"
    assert base[base.index("--max-steps") + 1] == str(budget.train_steps)


def test_summary_per_variant(bench) -> None:
    def record(variant: str, seed: int, al: float) -> dict:
        return {"variant": variant, "seed": seed, "al_vllm": al, "al_own": al, "al_offline": al + 0.5,
                "per_depth": [0.9, 0.7, 0.5, 0.4, 0.3], "train_seconds": 10.0}

    records = [record("baseline", s, 3.0 + 0.01 * s) for s in range(3)] + [record("k3", s, 2.5 + 0.01 * s) for s in range(3)]
    summary = bench.summarise(records)
    assert summary["k3"]["method"] == "peagle"  # a record from before the method was recorded
    assert summary["baseline"]["al_vllm"]["mean"] == pytest.approx(3.01) and "vs_baseline" not in summary["baseline"]
    assert summary["k3"]["al_offline"]["n"] == 3 and summary["k3"]["al_vllm"]["se"] == pytest.approx(0.01 / 3**0.5)
    assert summary["k3"]["vs_baseline"]["al_vllm"]["diff"] == pytest.approx(-0.5)
    assert summary["k3"]["vs_baseline"]["al_vllm"]["beyond_noise"] and "vs_reference" not in summary["k3"]
    # A variant built on another one is also compared with it.
    records += [record("muon", s, 3.5 + 0.01 * s) for s in range(3)] + [record("muon-lr0.05", s, 3.6 + 0.01 * s) for s in range(3)]
    summary = bench.summarise(records)
    ref = summary["muon-lr0.05"]["vs_reference"]
    assert ref["variant"] == "muon" and ref["al_vllm"]["diff"] == pytest.approx(0.1) and ref["al_vllm"]["beyond_noise"]
    assert summary["muon-lr0.05"]["vs_baseline"]["al_vllm"]["diff"] == pytest.approx(0.6)
    # EAGLE-3 at K = 3 is compared with P-EAGLE at K = 3, and its summary names its method.
    records += [{**record("defaults-k3", s, 2.0 + 0.01 * s), "method": "peagle"} for s in range(3)]
    records += [{**record("eagle3-k3", s, 2.2 + 0.01 * s), "method": "eagle3"} for s in range(3)]
    summary = bench.summarise(records)
    assert summary["eagle3-k3"]["method"] == "eagle3" and summary["defaults-k3"]["method"] == "peagle"
    assert summary["eagle3-k3"]["vs_reference"]["variant"] == "defaults-k3"
    assert summary["eagle3-k3"]["vs_reference"]["al_vllm"]["diff"] == pytest.approx(0.2)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode != 0,
                    reason="vllm is not importable here")
def test_smoke_run_writes_a_record_and_resumes(tmp_path) -> None:
    out = tmp_path / "quality.json"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--variants", "baseline", "--seeds", "0",
                           "--work", str(tmp_path / "work"), "--cache-dir", str(tmp_path / "cache"), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["variant"], r["seed"]) for r in result["records"]] == [("baseline", 0)]
    for rec in result["records"]:
        assert {"variant", "seed", "al_vllm", "al_own", "per_depth", "al_offline"} <= set(rec)
        assert 1.0 <= rec["al_vllm"] <= 6.0 and len(rec["per_depth"]) == 5
        assert rec["al_vllm"] == pytest.approx(rec["al_own"], rel=0.05)  # vLLM and our loop agree
    assert set(result["summary"]) == {"baseline"} and result["summary"]["baseline"]["al_vllm"]["n"] == 1
    assert result["target"]["variety"]["num_prompts"] == 3 and result["records"][0]["continuations"]["num_prompts"] == 3
    heldout = result["extract"]["vocab"]["heldout"]  # the vocab's coverage of the held-out text, by size
    assert 0 < heldout["coverage"] <= 1 and [256, heldout["coverage"]] in heldout["coverage_by_size"]
    # A re-run reuses the finished records instead of training again.
    again = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--variants", "baseline", "--seeds", "0",
                            "--work", str(tmp_path / "work"), "--cache-dir", str(tmp_path / "cache"), "--out",
                            str(tmp_path / "again.json"), "--no-variety"], capture_output=True, text=True, env=env,
                           timeout=1200)
    assert again.returncode == 0 and "reusing" in again.stdout
    # --report-only runs nothing: the finished record is reported, the missing seed is left out.
    report = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--variants", "baseline", "--seeds", "0,1",
                             "--work", str(tmp_path / "work"), "--cache-dir", str(tmp_path / "cache"), "--out",
                             str(tmp_path / "report.json"), "--no-variety", "--report-only"], capture_output=True,
                            text=True, env=env, timeout=600)
    assert report.returncode == 0 and "$ peagle" not in report.stdout, report.stdout[-2000:] + report.stderr[-2000:]
    reported = json.loads((tmp_path / "report.json").read_text())
    assert reported["records"] == result["records"] and "skipped" in reported["extract"]


def test_a_p_eagle_variant_trained_at_fewer_depths_is_served_at_them(bench) -> None:
    """`peagle eval` refuses a P-EAGLE K above its trained depths: k3 is served at K = 3, EAGLE-3's at 5."""
    budget = bench.Budget()
    assert bench.served_k("k3", bench.train_flags("k3", budget, seed=0)) == 3
    assert bench.served_k("k8", bench.train_flags("k8", budget, seed=0)) == 5
    assert bench.served_k("eagle3-k3", bench.train_flags("eagle3-k3", budget, seed=0)) == 5
