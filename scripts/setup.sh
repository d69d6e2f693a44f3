#!/usr/bin/env bash
# Create (or reuse) .venv and install ftkit with everything the demo and tests need.
# On a machine without an NVIDIA GPU the CPU build of torch is installed first,
# so pip never pulls a multi-GB CUDA build as a dependency: from PyTorch's CPU
# index when it can be reached, else from wherever pip is configured to look
# (PyPI's Linux wheel is the CUDA build; a local wheel directory may hold +cpu).
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
# pip compiles every module it installs on one core; compileall below does the same on all
# of them (the bytecode is needed: the tests' forkservers run python -B and would otherwise
# compile torch from source at every start).
pip_install() { "$VENV/bin/python" -m pip install -q --no-compile "$@"; }
if [ ! -f "$stamp" ]; then
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "setup: installing torch (CUDA build)" >&2
      pip_install "torch>=2.4" >&2
    else
      cpu_index=https://download.pytorch.org/whl/cpu
      if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null; then
        echo "setup: installing torch==2.13.0 (CPU build, from $cpu_index)" >&2
        pip_install "torch==2.13.0" --extra-index-url "$cpu_index" >&2
      else
        echo "setup: installing torch==2.13.0 ($cpu_index unreachable: pip's configured sources)" >&2
        pip_install "torch==2.13.0" >&2
      fi
    fi
  fi
  echo "setup: installing ftkit[$EXTRAS]" >&2
  pip_install -e ".[$EXTRAS]" >&2
  echo "setup: compiling the installed modules" >&2
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # Not the packages' own test suites, nor the ~550 transformers models the tests never import
  # (GPT-2 and the auto classes they do): a third of the files, a third of the minute this takes.
  skip='/tests/|/transformers/models/(?!auto/|gpt2/|__init__)'
  "$VENV/bin/python" -m compileall -q -j 0 -x "$skip" "$site" >/dev/null 2>&1 || true  # (a few packages ship test files that do not compile; pip skips them too)
  rm -f "$VENV"/.ftkit-setup-*
  touch "$stamp"
  fresh=1
fi

# The multi-host drills run a real etcd (v2 API, 3.4 line) for torch's etcd rendezvous: Debian's
# etcd-server, installed once where we are root and apt-get exists; a note otherwise (once per setup).
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing etcd-server (apt-get)" >&2
    apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1; }
    apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; } ||
      echo "setup: etcd-server could not be installed: multi-host drills with etcd rendezvous are unavailable" >&2
  elif [ -n "${fresh:-}" ]; then
    echo "setup: etcd not on PATH (needs root and apt-get: apt-get install etcd-server): multi-host drills with etcd rendezvous are unavailable" >&2
  fi
fi
