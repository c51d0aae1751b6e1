#!/usr/bin/env bash
# Megatron-Core's own unit tests under anyspeed's one line, on this machine's device:
#   scripts/megatron_tests.sh <Megatron-LM checkout at core_v0.16.1> [dirs or files...]
# (a directory or one file under tests/unit_tests, e.g. transformer or data/test_builder.py)
# Each test file runs on its own (torchrun, NPROC ranks, Megatron's usual 8) with a time
# limit; the summary (per directory passed / failed / skipped, files that did not finish,
# each failure classified, skip reasons) is printed and kept in OUT/summary.txt.
# Environment: NPROC (8), FILE_TIMEOUT seconds per file (600), TEST_TIMEOUT per test (300),
# OUT (megatron-tests-out), PYTHON (.venv/bin/python, set up by scripts/setup.sh), PYTEST_ARGS
# (more pytest arguments, e.g. "--deselect ID": Megatron's pyproject adds -x, so a file stops
# at its first failure; its later tests run when that one is deselected).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
checkout="$(cd "${1:?usage: scripts/megatron_tests.sh <Megatron-LM checkout> [dirs...]}" && pwd)"
shift
dirs=("$@")
if [ ${#dirs[@]} -eq 0 ]; then
  dirs=(tensor_parallel pipeline_parallel transformer dist_checkpointing distributed models
        optimizer data)
fi
NPROC="${NPROC:-8}"; FILE_TIMEOUT="${FILE_TIMEOUT:-600}"; TEST_TIMEOUT="${TEST_TIMEOUT:-300}"
OUT="$(mkdir -p "${OUT:-megatron-tests-out}" && cd "${OUT:-megatron-tests-out}" && pwd)"
PYTHON="${PYTHON:-$here/.venv/bin/python}"
[ -x "$PYTHON" ] || bash "$here/scripts/setup.sh"
# What Megatron-LM's tests import beyond megatron-core's own requirements (pybind11: its
# dataset helpers are compiled on first use).
"$PYTHON" -m pip install -q six pytest-mock pytest-timeout pybind11 2>/dev/null
mkdir -p "$OUT/results" "$OUT/logs"
rm -f "$OUT"/results/* "$OUT/files.tsv"
cd "$checkout"

# One test file on NPROC ranks in a session of its own: on timeout the whole session goes
# (torchrun's ranks included, which outlive a killed torchrun and would load the machine).
run_file() {
  setsid env ANYSPEED_MEGATRON_RESULTS="$2" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node "$NPROC" -m pytest -p anyspeed.testing.megatron -p no:cacheprovider -q \
    --timeout "$TEST_TIMEOUT" ${PYTEST_ARGS:-} "$1" > "$3" 2>&1 &
  local pid=$! waited=0 rc
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$FILE_TIMEOUT" ]; do
    sleep 1; waited=$((waited + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 124
  fi
  wait "$pid"; rc=$?
  kill -KILL -- "-$pid" 2>/dev/null  # anything the file left behind
  return "$rc"
}
for d in "${dirs[@]}"; do
  [ -e "tests/unit_tests/$d" ] || { echo "no tests/unit_tests/$d in $checkout" >&2; exit 2; }
  while IFS= read -r f; do
    name="${f//\//_}"
    printf '%s ... ' "$f"
    set +e
    run_file "$f" "$OUT/results/${name%.py}" "$OUT/logs/${name%.py}.log"
    rc=$?
    set -e
    case $rc in
      0|1|5) status=ok ;;  # pytest: all passed / some failed / none collected
      124|137) status="timeout after ${FILE_TIMEOUT}s" ;;
      *) status="exit $rc" ;;
    esac
    printf '%s\t%s\n' "$f" "$status" >> "$OUT/files.tsv"
    echo "$status"
  done < <(find "tests/unit_tests/$d" -name 'test_*.py' -type f | sort)
done
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m anyspeed.testing.megatron_report \
  "$OUT" | tee "$OUT/summary.txt"
