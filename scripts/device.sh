#!/usr/bin/env bash
# The GPU checks of issue 49 on a lent CUDA machine (no network there; CI never runs this).
#
#   scripts/device.sh prepare <Megatron-LM git dir>   here, once: what the device lacks
#   scripts/device.sh run [gpu|kernels|fp8|generate|check|all]   there, from the checkout's root
#
# prepare: downloads the wheels the device image lacks (megatron-core at pyproject's pin and
# zstandard, for its Python 3.12) into .whl/, and Megatron-LM's pretrain_gpt.py with its
# megatron/ package at core_v0.16.1 into mlm/ (for benchmarks/gpu.py's row without anyspeed),
# with the wheel's compiled dataset helpers;
# both are ignored by git here and travel when the device call names them in `carry`.
# run: installs the wheels into /tmp/site, then runs, each under its own time limit and logged
# to $OUT/<name>.log: gpu (benchmarks/gpu.py, training MFU), kernels (benchmarks/ops.py: each
# level-1 kernel against Megatron's at the 1.5B shape), fp8 (benchmarks/gpu.py: level 2 with
# and without --fp8-format, anyspeed's FP8 GEMMs on torch._scaled_mm), generate
# (benchmarks/generate.py at batch 64, decode against transformers) and check
# (scripts/gpu_check.py, CUDA parity).
# GPU_ARGS adds arguments to benchmarks/gpu.py (--dry: the tiny model, to try this script).
# A device call: command "bash scripts/device.sh run gpu", carry [".whl", "mlm"]. A session's
# 15 device minutes fit a machine's start, `run gpu` (560 s at most) and `run kernels` (150 s);
# `run generate` (180 s) when `run gpu` ended early; `run fp8` (280 s) in a second session.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
  local mirror="${1:?usage: scripts/device.sh prepare <Megatron-LM git dir>}"
  local pin
  pin="$(grep -o 'megatron-core==[0-9.]*' pyproject.toml)"
  mkdir -p .whl mlm .git/info
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pin" zstandard
  git --git-dir="$mirror" archive core_v0.16.1 pretrain_gpt.py gpt_builders.py \
    mamba_builders.py model_provider.py megatron | tar -x -C mlm
  # the wheel's compiled dataset helpers beside Megatron-LM's sources (benchmarks/
  # megatron_pretrain.py then skips rebuilding them, which needs a compiler and Python's headers)
  python3 - .whl/megatron_core-*.whl mlm/megatron/core/datasets <<'PY'
import sys, zipfile, os
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("megatron/core/datasets/helpers_cpp") and name.endswith(".so"):
            with open(os.path.join(sys.argv[2], os.path.basename(name)), "wb") as f:
                f.write(z.read(name))
PY
  for path in /.whl/ /mlm/; do
    grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
  done
  du -sh .whl mlm
}

step() {  # name, seconds, command...: one check, logged, its exit status reported
  local name="$1" limit="$2"
  shift 2
  echo "== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}

run() {
  local what="${1:-all}"
  OUT="${OUT:-device-out}"
  mkdir -p "$OUT"
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  fi
  export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  [ -f mlm/pretrain_gpt.py ] && export ANYSPEED_MEGATRON_LM="$PWD/mlm"
  python3 -W ignore -c "import torch, megatron.core as m; print('torch', torch.__version__, '|',
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', '|',
    'megatron-core', m.__version__)" || exit 1
  case "$what" in
    gpu) step gpu "${GPU_LIMIT:-560}" python3 benchmarks/gpu.py --row-timeout 120 \
      --megatron-timeout 200 ${GPU_ARGS:-} ;;
    kernels) step kernels "${KERNELS_LIMIT:-150}" python3 benchmarks/ops.py --skip-e2e \
      --shape qwen2.5-1.5b --dtype bf16 --seq-length 4096 --reps 5 ;;
    fp8) step fp8 "${FP8_LIMIT:-280}" python3 benchmarks/gpu.py --levels 2 --fp8-recipe \
      tensorwise --no-megatron --profile-levels --row-timeout 130 ${GPU_ARGS:-} ;;
    generate) step generate "${GEN_LIMIT:-180}" python3 benchmarks/generate.py --batch 64 \
      --new-tokens 64 --repeats 3 --no-nocache ;;
    check) step check "${CHECK_LIMIT:-400}" python3 scripts/gpu_check.py ;;
    all) run gpu && run kernels && run fp8 && run generate && run check ;;
    *) echo "scripts/device.sh run: unknown check '$what'" \
         "(gpu, kernels, fp8, generate, check or all)" >&2
       exit 2 ;;
  esac
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: scripts/device.sh prepare <Megatron-LM git dir>" \
          "| run [gpu|kernels|fp8|generate|check|all]" >&2
     exit 2 ;;
esac
