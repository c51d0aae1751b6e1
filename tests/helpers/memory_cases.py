"""The memory tests' shared cases and their one-process-group runner (tests/memory)."""

from __future__ import annotations

import dataclasses

from anyspeed.models.presets import get_preset
from anyspeed.testing import run_distributed
from helpers import memory_ranks

MODEL = dict(num_layers=2)  # hidden 64, ffn 128, 4 heads, SwiGLU, RMSNorm, vocab 256
CFG = dict(seq_length=32, micro_batch_size=2, global_batch_size=2)
ACT = ["--recompute-activation-function"]
NORM = ["--recompute-norm"]
FULL = dict(granularity="full", method="uniform", num_layers=1)
SELECTIVE = dict(granularity="selective", modules=["core_attn", "mlp", "layernorm"])
CASES = {
    "none": dict(trace=True),  # also the allocator's measured bytes (the estimator test)
    "full-uniform": dict(recompute=FULL),
    "selective": dict(recompute=SELECTIVE),
    "act": dict(argv=ACT),
    "norm": dict(argv=NORM),
    "act+norm+swap": dict(
        argv=ACT + NORM + ["--swap-attention", "--swap-optimizer"], offload=True
    ),  # the offload's copies, CPU to CPU
    "offload": dict(offload=True),
}
MOE_MODEL = dataclasses.asdict(get_preset("tiny-qwen3-moe"))  # MoE layers and q/k norms


def _dense(preset: str, **over) -> dict:
    """A tiny preset's fields without its experts."""
    return dataclasses.asdict(dataclasses.replace(get_preset(preset), num_experts=None, **over))


EXTRA_CASES = {  # run with CASES in the same process group (CI time), not recompute parity cases
    "bf16-none": dict(bf16=True),
    "bf16-offload": dict(bf16=True, offload=True),
    "moe": dict(model=MOE_MODEL),
    "moe-act": dict(model=MOE_MODEL, argv=ACT),
    # multi-latent attention (dense, so exact), with and without low-rank queries, DeepSeek-V3.2's
    # indexer frozen and trained, gated DeltaNets (Qwen3.5: 64-token chunks, so seq 128)
    "mla": dict(model=_dense("tiny-deepseek-v3", mtp_num_layers=None)),
    "mla-noq": dict(model=_dense("tiny-deepseek-v3", mtp_num_layers=None, q_lora_rank=None)),
    "dsa": dict(model=_dense("tiny-deepseek-v3.2")),
    "dsa-kl": dict(model=_dense("tiny-deepseek-v3.2", dsa_indexer_loss_coeff=0.5)),
    "delta": dict(model=dataclasses.asdict(get_preset("tiny-qwen3.5")), seq_length=128),
    # Gemma 2: sandwich norms, soft-capped S x S scores (Megatron's path), tanh GeGLU, capped
    # logits, zero-centred norms
    "gemma2": dict(model=dataclasses.asdict(get_preset("tiny-gemma2"))),
    "gemma2-bf16": dict(model=dataclasses.asdict(get_preset("tiny-gemma2")), bf16=True),
    # LongRoPE (unfused RoPE: its attention factor), RoPE on 3/4 of each head, a window
    "phi3": dict(model=dataclasses.asdict(get_preset("tiny-phi3"))),
    # a sliding window on the first of two layers (GPT-OSS's blocked attention, without sinks)
    "window": dict(model=dict(MODEL, window_size=3, window_attn_skip_freq="2")),
}
FP8 = dict(argv=["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
           fp8=dict(recipe="tensorwise"))  # fmt: skip
FP8_CASES = {  # --fp8-format: the linears keep one-byte inputs
    "fp8": FP8,
    "fp8-act-norm": dict(FP8, argv=FP8["argv"] + ACT + NORM),
    "fp8-selective": dict(FP8, recompute=SELECTIVE),
    "fp8-core-attn": dict(FP8, recompute=dict(granularity="selective", modules=["core_attn"])),
    "fp8-bf16": dict(FP8, bf16=True),
    "fp8-moe": dict(FP8, model=MOE_MODEL),
}
GELU_CASES = {  # -m slow (CI time)
    "gelu-act": dict(argv=ACT, model=dict(MODEL, swiglu=False)),
    "gelu-none": dict(model=dict(MODEL, swiglu=False)),
}


def run_cases(world: int, layout: dict, cases: dict, **common) -> dict:
    """Every case of ``cases`` at ``layout`` in one process group: name -> per-rank results."""
    base = {**dict(layout=layout, model=MODEL, **CFG), **common}
    spec = [dict(base, **case) for case in cases.values()]
    per_rank = run_distributed(memory_ranks.metered_cases, world, cases=spec, timeout=600)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(cases)}
