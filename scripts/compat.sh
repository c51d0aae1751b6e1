#!/usr/bin/env bash
# The fast suite on other versions of torch and transformers than .venv's, in a venv of its own
# (not CI's job: it downloads several GB where the torch asked for is a CUDA build).
#
#   scripts/compat.sh <venv dir> <pip requirement>...   e.g.
#   scripts/compat.sh /tmp/v211 torch==2.11.0 transformers==5.17.0
#
# The requirements are installed first, then anyspeed with its test extra (which keeps them
# where they satisfy pyproject's ranges), then the suite runs as scripts/test.sh runs it.
# PYTEST_ARGS replaces the selection (default: the fast suite, one worker per core).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:?usage: scripts/compat.sh <venv dir> <pip requirement>...}"
shift
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ $# -gt 0 ]; then
  "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true
fi
"$VENV/bin/python" -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -W ignore -c "import sys, torch, transformers, megatron.core as m
print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers',
      transformers.__version__, '| megatron-core', m.__version__)"
WORKERS=$(( $(nproc 2>/dev/null || echo 1) > 4 ? 4 : $(nproc 2>/dev/null || echo 1) ))
# shellcheck disable=SC2086
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  ${PYTEST_ARGS:--n $WORKERS --dist worksteal -m "not slow and not alone"}
