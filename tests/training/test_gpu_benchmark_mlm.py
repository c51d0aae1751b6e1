"""The reference row of ``benchmarks/gpu.py`` passes Megatron-LM's own checks: its flags go
through ``pretrain_gpt.py``'s argument parsing and validation and build a TransformerConfig,
in a process without anyspeed. Without Transformer Engine the defaults alone stop there, which
a device run would only show after its machine's start. Needs a Megatron-LM checkout at
$ANYSPEED_MEGATRON_LM (core_v0.16.1) and the ``megatron-lm`` extra."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.megatron_lm import MARKS, MLM

pytestmark = MARKS
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

CHECK = """
import importlib.util, json, os, sys, types
if importlib.util.find_spec("triton") is None:  # imported by megatron.training, GPU kernels
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    stub = types.ModuleType(name)
    stub.enable_batch_invariant_mode = None
    sys.modules[name] = stub
from megatron.training.arguments import (core_transformer_config_from_args, parse_args,
                                         validate_args)
sys.argv = ["pretrain_gpt.py", *json.loads(sys.argv[1])]
args = parse_args()
args.world_size, args.rank = 1, 0
validate_args(args)
try:
    cfg = core_transformer_config_from_args(args)
except ValueError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({k: getattr(cfg, k) for k in ("apply_rope_fusion",
        "gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion",
        "bias_dropout_fusion", "num_layers", "hidden_size")}))
"""


def _check(flags: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=MLM, WORLD_SIZE="1", RANK="0")
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CHECK, json.dumps(flags)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("six") is None, reason="the megatron-lm extra")
def test_the_reference_rows_flags_pass_megatron_lms_checks() -> None:
    spec = importlib.util.spec_from_file_location("gpu_benchmark", BENCH / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    flags = bench.megatron_flags(10, False, "151936")
    cfg = _check(flags)
    assert (cfg["num_layers"], cfg["hidden_size"]) == (28, 1536)
    # the compiled fusions stay on; the kernels this machine lacks are off
    assert cfg["bias_activation_fusion"] and cfg["bias_dropout_fusion"]
    if importlib.util.find_spec("transformer_engine") is None:
        assert cfg["apply_rope_fusion"] is False
        # what Megatron-LM's defaults alone do without Transformer Engine
        missing = set(bench.missing_kernel_flags())
        bare = _check([f for f in flags if f not in missing])
        assert "apply_rope_fusion is not available" in bare["error"]
