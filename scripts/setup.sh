#!/usr/bin/env bash
# Create .venv (Python 3.11) if missing and install torch==2.13.0 (CPU build) first, then lowband.
# Idempotent: re-installs only when pyproject.toml or this script changed. Extras: dev (tests, lint) and
# ft (torchft==0.2.0 for fault-tolerant DiLoCo, whose tests run in CI) and hf (transformers, test-only: the
# Hugging Face GPT-2 external tests) and tb (tensorboard, for run.tensorboard and its test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.lowband-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,ft,hf,tb]"
  echo "$want" > "$stamp"
fi
