#!/usr/bin/env bash
# The GPU suite: everything issue 14 measures on one GPU, as ONE command (< 10 min on one H100, no network).
#
#   bash benchmarks/gpu_suite.sh --speculators-anchor .anchor/speculators_gpu      # on the GPU machine
#   bash benchmarks/gpu_suite.sh --smoke --out /tmp/suite-smoke                     # toy shapes on CPU (< 3 min)
#
# Parts, in this order (each its own time budget; one that fails or runs out writes null with the
# reason in the summary and the others still run; the whole suite stops starting parts at --budget):
#   env              device, date, torch                                  (gpu_summary.py env)
#   train_step       peagle's train step, 1 and 4 layers at L = 8192      (train_step.py)
#   speculators      the reference harness, same shapes, same run          (ANCHOR/bench.py)
#   train_run        a real `peagle train`, 60 steps, synthetic 8B store   (train_run.py)
#   cuda_tests       pytest -m cuda                                       (junit counts)
#   extract          HF extract vs a bare prefill, random 8B Llama         (extract_throughput.py)
#   longest_context  4 layers, S = 4, activation checkpointing, L = 16k..128k until OOM (train_step.py)
# Raw output of every part goes to OUT/parts, logs to OUT/logs, and OUT/summary.json gets the keys
# (gpu_summary.py). OUT defaults to benchmarks/results/gpu (commit it with the results); --smoke
# writes only under --out (default: a new temp dir) and refuses the committed results folder.
#
# Wheels: with a .whl/ folder (scripts/download_gpu_wheels.sh fills it), the suite first runs
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# and puts /tmp/site first on PYTHONPATH (speculators and what it needs; peagle needs nothing the image lacks).
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)

SMOKE=0 OUT="" WORK="" ANCHOR="" BUDGET=575
ALL_PARTS="env train_step speculators train_run cuda_tests extract longest_context"
PARTS="$ALL_PARTS"

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; cat <<EOF

Options:
  --smoke                    every part at toy shapes on CPU (CUDA-only parts: null with the reason)
  --out DIR                  results folder (default: benchmarks/results/gpu; with --smoke: a temp dir)
  --work DIR                 big scratch files: stores, targets, runs (default: /tmp/peagle-gpu-suite)
  --speculators-anchor DIR   the reference harness folder (bench.py); absent: speculators keys are null
  --parts "A B"              run only these parts (default: all); the summary reads every part in OUT,
                             so a second call can complete a run that ran out of time
  --budget SECONDS           start no part after this many seconds (default: 575)
EOF
}

while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --work) WORK=${2:?--work needs a folder}; shift ;;
    --speculators-anchor) ANCHOR=${2:?--speculators-anchor needs a folder}; shift ;;
    --parts) PARTS=${2:?--parts needs a list}; shift ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_suite.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for p in $PARTS; do
  case " $ALL_PARTS " in *" $p "*) ;; *) echo "gpu_suite.sh: error: unknown part $p (parts: $ALL_PARTS)" >&2; exit 2 ;; esac
done
if [ -n "$ANCHOR" ] && [ ! -f "$ANCHOR/bench.py" ]; then
  echo "gpu_suite.sh: error: --speculators-anchor $ANCHOR has no bench.py" >&2; exit 2
fi

COMMITTED="$REPO/benchmarks/results/gpu"
if [ "$SMOKE" = 1 ]; then
  OUT=${OUT:-$(mktemp -d /tmp/peagle-gpu-smoke.XXXXXX)}
  case "$(realpath -m "$OUT")/" in "$(realpath -m "$COMMITTED")/"*)
    echo "gpu_suite.sh: error: --smoke never writes over the committed GPU results ($COMMITTED); pass another --out" >&2
    exit 2 ;;
  esac
else
  OUT=${OUT:-$COMMITTED}
fi
WORK=${WORK:-/tmp/peagle-gpu-suite}
mkdir -p "$OUT/parts" "$OUT/logs" "$WORK"
OUT=$(cd "$OUT" && pwd -P)

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "$SMOKE" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "installing .whl/*.whl into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

START=$(date +%s)
DEADLINE=$(( START + BUDGET ))

status() {  # status NAME STATUS SECONDS BUDGET REASON
  local reason=${5//\\/\\\\}
  reason=${reason//\"/\\\"}
  printf '{"part": "%s", "status": "%s", "seconds": %s, "budget_s": %s, "reason": "%s", "finished": "%s"}\n' \
    "$1" "$2" "$3" "$4" "$reason" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$OUT/parts/$1.status.json"
}

selected() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

run_part() {  # run_part NAME BUDGET_SECONDS CMD...: runs CMD under timeout, logs, writes its status
  local name=$1 budget=$2; shift 2
  selected "$name" || return 0
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 20 ]; then
    status "$name" skipped 0 "$budget" "the suite's --budget ($BUDGET s) was spent before this part"
    echo "== $name: skipped (suite budget spent)"; return 0
  fi
  [ "$budget" -gt $(( left - 5 )) ] && budget=$(( left - 5 ))
  echo "== $name (budget ${budget}s, ${left}s left)"
  local t0=$(date +%s) rc
  timeout -k 10 "$budget" "$@" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  local secs=$(( $(date +%s) - t0 ))
  if [ "$rc" = 0 ]; then
    status "$name" ok "$secs" "$budget" ""
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status "$name" timeout "$secs" "$budget" "ran out of its ${budget}s budget"
  else
    local last
    last=$(grep -v '^\s*$' "$OUT/logs/$name.log" | tail -n 1 | cut -c1-300)
    status "$name" error "$secs" "$budget" "exit $rc: $last"
  fi
  echo "   $(cat "$OUT/parts/$name.status.json")"
}

skip_part() {  # skip_part NAME REASON
  selected "$1" || return 0
  status "$1" skipped 0 0 "$2"
  echo "== $1: skipped ($2)"
}

if selected env; then
  "$PY" benchmarks/gpu_summary.py env --out "$OUT/parts/env.json" > "$OUT/logs/env.log" 2>&1 \
    && status env ok 0 0 "" || status env error 0 0 "$(tail -n 1 "$OUT/logs/env.log")"
fi

if [ "$SMOKE" = 1 ]; then
  # One thread per process: toy shapes gain nothing from more, and on a shared CPU OpenMP's
  # barriers make a 2-thread toy matmul 20x slower than a 1-thread one.
  export OMP_NUM_THREADS=1
  rm -f "$OUT/parts/train_step.jsonl" "$OUT/parts/speculators.jsonl" "$OUT/parts/longest_context.jsonl"
  run_part train_step 60 "$PY" benchmarks/train_step.py --tiny --device cpu --layers 1 4 --seqlens 256 \
    --partitions 1 --attention sdpa --warmup 1 --iters 2 --threads 1 --profile --out "$OUT/parts/train_step.jsonl"
  if [ -n "$ANCHOR" ]; then
    run_part speculators 120 "$PY" "$ANCHOR/bench.py" --mode model --tiny --device cpu --cpu-attn-shim --eager --loss-impl eager \
      --layers 1 4 --seqlens 256 --warmup 1 --iters 2 --variant smoke --out "$OUT/parts/speculators.jsonl"
  else
    skip_part speculators "no --speculators-anchor given"
  fi
  run_part train_run 120 "$PY" benchmarks/train_run.py --tiny --steps 12 --workers 1 --work "$WORK/train_run" \
    --out "$OUT/parts/train_run.json"
  skip_part cuda_tests "CUDA-only: the smoke run is on CPU (pytest -m cuda skips without a device)"
  run_part extract 90 "$PY" benchmarks/extract_throughput.py --shape tiny --device cpu --records 8 --max-words 30 \
    --repeats 1 --threads 1 --workdir "$WORK/extract" --out "$OUT/parts/extract.json"
  run_part longest_context 60 "$PY" benchmarks/train_step.py --tiny --device cpu --layers 4 --seqlens 256 512 \
    --partitions 2 --attention sdpa --activation-checkpointing --warmup 1 --iters 1 --threads 1 \
    --out "$OUT/parts/longest_context.jsonl"
else
  selected train_step && rm -f "$OUT/parts/train_step.jsonl"
  selected speculators && rm -f "$OUT/parts/speculators.jsonl"
  selected longest_context && rm -f "$OUT/parts/longest_context.jsonl"
  run_part train_step 100 "$PY" benchmarks/train_step.py --layers 1 4 --seqlens 8192 --partitions 1 \
    --attention flex --warmup 2 --iters 5 --profile --out "$OUT/parts/train_step.jsonl"
  if [ -n "$ANCHOR" ]; then
    run_part speculators 180 "$PY" "$ANCHOR/bench.py" --mode model --layers 1 4 --seqlens 8192 --warmup 2 \
      --iters 5 --patch-autotune-configs --variant compiled+configs-copy-patch \
      --deadline-epoch $(( $(date +%s) + 170 )) --min-left 40 --out "$OUT/parts/speculators.jsonl"
  else
    skip_part speculators "no --speculators-anchor given"
  fi
  run_part train_run 150 "$PY" benchmarks/train_run.py --steps 60 --work "$WORK/train_run" \
    --out "$OUT/parts/train_run.json"
  run_part cuda_tests 130 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests \
    --junitxml "$OUT/parts/cuda_tests.xml"
  run_part extract 130 "$PY" benchmarks/extract_throughput.py --shape 8b --device cuda --records 128 \
    --max-words 300 --repeats 1 --workdir "$WORK/extract" --out "$OUT/parts/extract.json"
  run_part longest_context 120 "$PY" benchmarks/train_step.py --layers 4 --seqlens 16384 32768 65536 131072 \
    --partitions 4 --attention flex --activation-checkpointing --warmup 1 --iters 2 \
    --out "$OUT/parts/longest_context.jsonl"
fi

SMOKE_FLAG=()
[ "$SMOKE" = 1 ] && SMOKE_FLAG=(--smoke)
"$PY" benchmarks/gpu_summary.py summary --dir "$OUT" "${SMOKE_FLAG[@]}" --suite-seconds $(( $(date +%s) - START ))
