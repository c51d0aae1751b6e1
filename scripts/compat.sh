#!/usr/bin/env bash
# The fast suite on other versions of torch and transformers than .venv's, in a venv of its own
# (not CI's job: it downloads several GB where the torch asked for is a CUDA build).
#
#   scripts/compat.sh <venv dir> <pip requirement>...   e.g.
#   scripts/compat.sh /tmp/v211 torch==2.11.0 transformers==5.17.0
#
# The requirements are installed first, then anyspeed with its test extra under them as
# constraints: a release below pyproject's floor is a pip conflict, not a silent upgrade. Then
# the suite runs as scripts/test.sh runs it.
# PYTEST_ARGS replaces the selection (default: the fast suite, one worker per core).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:?usage: scripts/compat.sh <venv dir> <pip requirement>...}"
shift
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install() {  # pip's own output only when it fails
  if ! "$VENV/bin/python" -m pip install -q "$@" > "$VENV/pip.log" 2>&1; then
    grep -v "^WARNING: Location" "$VENV/pip.log" >&2
    exit 1
  fi
}
printf '%s\n' "$@" > "$VENV/constraints.txt"
[ $# -eq 0 ] || pip_install "$@"
pip_install -e ".[test]" -c "$VENV/constraints.txt"
"$VENV/bin/python" -W ignore -c "import sys, torch, transformers, megatron.core as m
print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers',
      transformers.__version__, '| megatron-core', m.__version__)"
CORES=$(nproc 2>/dev/null || echo 1)
WORKERS=$(( CORES > 4 ? 4 : CORES ))
# shellcheck disable=SC2086
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  ${PYTEST_ARGS:--n $WORKERS --dist worksteal -m "not slow and not alone"}
