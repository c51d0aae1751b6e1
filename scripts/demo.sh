#!/usr/bin/env bash
# Main job: set up, then run the whole LLM workflow offline on 2 CPU processes: a corpus from the
# Python standard library, a trained BPE tokenizer, preprocessing to .bin/.idx, and pretraining of
# a small Qwen2.5-architecture model at TP=2 with a checkpoint and a generated sample.
# Extra flags go to `anyspeed pretrain` (e.g. --bf16, --train-iters 800).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/anyspeed demo --workdir "${ANYSPEED_DEMO_DIR:-anyspeed-demo}" "$@"
