#!/usr/bin/env bash
# Set up (or reuse) .venv and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra "$@"
