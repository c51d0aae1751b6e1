#!/usr/bin/env bash
# Main job: set up, then pretrain a tiny GPT through megatron.core on 2 CPU processes (TP=2,
# sequence parallel), printing loss, tokens/s, TFLOP/s, MFU and memory. Extra flags pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/anyspeed smoke --nproc-per-node 2 --tensor-model-parallel-size 2 \
  --sequence-parallel --train-iters 40 "$@"
