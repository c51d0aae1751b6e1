#!/usr/bin/env bash
# Whole test suite: set up, lint, a static check, then pytest (slow checks are marked and excluded
# by default; arguments go to one pytest process as they are; the Megatron-LM checks run when
# ANYSPEED_MEGATRON_LM points at a Megatron-LM checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
# Static check: imports of names that do not exist, attributes a module lacks (pyproject [tool.mypy]).
.venv/bin/python -m mypy
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"  # the caller's selection, in one process
fi
# The whole fast suite: one pytest-xdist worker per core (at most 4), an idle worker taking tests
# queued for the other (worksteal), then the tests that measure the machine, alone. The 25 slowest
# are listed at the end, to keep the suite within its time budget.
WORKERS=${ANYSPEED_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
WORKERS=$(( WORKERS > 4 ? 4 : WORKERS ))
"${PYTEST[@]}" -n "$WORKERS" --dist worksteal -m "not slow and not alone" --durations=25
exec "${PYTEST[@]}" -m "alone and not slow"
