#!/usr/bin/env bash
# Creates the speculators environment of benchmarks/peer_ab.py (default .venv-speculators) from
# locks/speculators.txt: speculators 0.9.0 and exactly what its P-EAGLE training imports, with
# `pip install --no-deps`, so nothing it declares beyond that (CUDA builds of torchvision/torchaudio,
# vLLM clients) comes along. It never touches the project's .venv: speculators' dependencies break
# vLLM on CPU there. Idempotent: a venv made from this very lock is left as is; one made from
# another lock is made anew.
#
# Usage: scripts/speculators_venv.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-speculators}
LOCK=locks/speculators.txt
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp="$VENV/.lock-sha256"
want=$(sha256sum "$LOCK" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
python_want=$(sed -n 's/^# python //p' "$LOCK")
python_have=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$python_want" != "$python_have" ]; then
  echo "speculators_venv.sh: $PY is Python $python_have but $LOCK is for Python $python_want:" \
       "run PYTHON=python$python_want bash scripts/speculators_venv.sh" >&2
  rm -rf "$VENV"
  exit 1
fi
"$VENV/bin/python" -m pip install -q --no-deps --no-compile -r "$LOCK"  # .pyc: the import check's modules only
err=$(mktemp)
trap 'rm -f "$err"' EXIT
# The check below writes the .pyc of what it imports (what the trainer imports), also where
# PYTHONDONTWRITEBYTECODE is set (CI): without them every later process compiles them again, ~25 s of CPU.
if ! env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c "import speculators.train.trainer, speculators.models.peagle, torch
assert torch.__version__.endswith('+cpu'), torch.__version__" 2>"$err"; then
  echo "speculators_venv.sh: speculators is installed in $VENV but does not import:" >&2
  tail -n 5 "$err" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "speculators_venv.sh: speculators 0.9.0 ready in $VENV ($(( $(date +%s) - start )) s)"
