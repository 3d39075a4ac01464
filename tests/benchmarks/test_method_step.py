"""benchmarks/method_step.py at a toy size (``--shape tiny``): both methods run through the real trainer, the JSON
holds a row per (method, K) and EAGLE-3's ratios; what it says about time is the benchmark's, not this test's."""

from __future__ import annotations

import json

def test_a_toy_run_writes_one_row_per_method_and_depth(tmp_path, load_benchmark) -> None:
    with load_benchmark("method_step.py") as bench:
        out = tmp_path / "method_step.json"
        result = bench.main(["--shape", "tiny", "--depths", "2", "3", "--token-budget", "128", "--sample-tokens", "65",
                             "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {(r["method"], r["num_depths"]): r for r in result["rows"]}
    assert set(rows) == {("peagle", 2), ("eagle3", 2), ("peagle", 3), ("eagle3", 3)}
    for (method, k), row in rows.items():
        assert row["tokens_per_batch"] == 128 and len(row["cpu_s_all"]) == len(row["wall_s_all"]) == 1
        # EAGLE-3 trains every chain: at least P-EAGLE's elements (its COD draw is a subset of the same pools).
        if method == "eagle3":
            assert row["elements_per_batch"] >= rows[("peagle", k)]["elements_per_batch"]
    assert rows[("eagle3", 3)]["elements_per_batch"] > rows[("eagle3", 2)]["elements_per_batch"]
    assert set(result["eagle3_over_peagle"]) == {"2", "3"}
