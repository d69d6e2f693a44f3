#!/usr/bin/env bash
# Set up (or reuse) .venv and run the demo: train, SIGKILL, inspect and restore
# from the CLI, resume, and compare with an uninterrupted run bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
FTKIT_EXTRAS=${FTKIT_EXTRAS:-test} scripts/setup.sh
exec .venv/bin/python -m ftkit.demo "$@"
