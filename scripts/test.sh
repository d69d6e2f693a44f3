#!/usr/bin/env bash
# Set up (or reuse) .venv, lint and type-check, then run the whole test suite. Extra args go to pytest.
# Two workers, one test file each at a time (--dist loadfile): the drills, split over two
# files (test_drill.py, test_drill_faults.py, about 3 minutes each here), and the rest of the
# suite share them; most of a drill is waiting (step sleeps, detection bounds, restarts),
# so two jobs share the 2 cores without missing a bound. Files go out in collection order,
# the slowest first (tests/conftest.py SLOW_FILES), not xdist's most-tests-first, which
# left a drill to run alone at the end. The 15 slowest tests are listed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check ftkit tests benchmarks scripts examples
.venv/bin/ruff format --check --quiet ftkit tests benchmarks scripts examples
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder --durations=15 "$@"
