#!/usr/bin/env bash
# Creates .venv (if needed) and installs exactly the tested versions of peagle's dependencies and test
# tools (locks/base.txt; torch is the CPU build), then peagle itself (editable).
# Idempotent: a venv that matches the lock installs nothing; one that drifted from it (another
# install changed a version, the lock was refreshed) is put back to the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
want=$(sed -n 's/^# python //p' locks/base.txt)
have=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$want" != "$have" ]; then
  echo "setup.sh: .venv runs Python $have but the lock is for Python $want: remove .venv and run" \
       "PYTHON=python$want bash scripts/setup.sh" >&2
  exit 1
fi
if ! .venv/bin/python scripts/lock.py check --quiet; then
  # --no-deps: the lock is the whole closure; pip resolves nothing, so nothing untested comes along
  .venv/bin/python -m pip install -q --no-deps -r locks/base.txt
  .venv/bin/python -m pip install -q --no-deps -e .
  .venv/bin/python scripts/lock.py check  # lists what still differs, and fails
fi
