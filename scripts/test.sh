#!/usr/bin/env bash
# Whole test suite: set up, lint, then pytest (slow checks are marked and excluded by default;
# the Megatron-LM checks run when ANYSPEED_MEGATRON_LM points at a Megatron-LM checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
