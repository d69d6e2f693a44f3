#!/usr/bin/env bash
# Create (or reuse) .venv and install ftkit with everything the demo and tests need.
# On a machine without an NVIDIA GPU the CPU build of torch is installed first,
# so pip never pulls a multi-GB CUDA build as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FTKIT_VENV:-.venv}
EXTRAS=${FTKIT_EXTRAS:-test}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
fi

# Reinstall only when the project's requirements changed since the last setup.
stamp="$VENV/.ftkit-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)-$EXTRAS"
if [ ! -f "$stamp" ]; then
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "setup: installing torch (CUDA build)" >&2
      "$VENV/bin/python" -m pip install -q "torch>=2.4" >&2
    else
      echo "setup: installing torch==2.13.0 (CPU build)" >&2
      "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
    fi
  fi
  echo "setup: installing ftkit[$EXTRAS]" >&2
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" >&2
  rm -f "$VENV"/.ftkit-setup-*
  touch "$stamp"
fi
