#!/usr/bin/env bash
# Whole test suite: set up, lint, a static check, then pytest (slow checks are marked and excluded
# by default; the Megatron-LM checks run when ANYSPEED_MEGATRON_LM points at a Megatron-LM checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
# Static check: imports of names that do not exist, attributes a module lacks (pyproject [tool.mypy]).
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
