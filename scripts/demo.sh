#!/usr/bin/env bash
# Set up (or reuse) .venv and run the demo: train, SIGKILL, inspect and restore
# from the CLI, resume, and compare with an uninterrupted run bit for bit; then
# the default drill: faults injected into a 4-rank torchrun job, nothing lost.
set -euo pipefail
cd "$(dirname "$0")/.."
FTKIT_EXTRAS=${FTKIT_EXTRAS:-test} scripts/setup.sh
.venv/bin/python scripts/demo.py "$@"
echo
echo "== 5. a failure drill: kill, hang, lose a node and crash a 4-rank torchrun job"
exec .venv/bin/ftkit drill
