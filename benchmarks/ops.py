"""Level 0 (Megatron's local kernels) vs level 1 (anyspeed's), side by side in one run.

Part 1, per kernel (forward + backward, 1 process): median time, bytes saved for the backward
pass (activation memory, counted by autograd's saved-tensor hooks) and the process's peak-RSS
growth during the call.
Part 2, end to end: tokens/s and peak RSS per rank of a ~55M-parameter Qwen2.5-architecture GPT
(GQA, QKV bias, RMSNorm, SwiGLU, RoPE base 1e6) at sequence 2048 on 2 CPU processes (DP2), for
level 0 fp32, level 1 fp32 and level 1 bf16.

    python benchmarks/ops.py [--seq-length 2048] [--steps 2] [--skip-e2e] [--skip-kernels]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from anyspeed.testing import run_distributed


# ------------------------------------------------------------------------------------ part 1
def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _measure(fn, reps: int) -> dict:
    from anyspeed.device import cpu_cuda

    fn().float().sum().backward()  # warm-up
    times = []
    cpu_cuda.reset_peak_memory_stats()
    base = cpu_cuda.memory_allocated()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn().float().sum().backward()
        times.append(time.perf_counter() - t0)
    peak = cpu_cuda.max_memory_allocated() - base
    return {
        "ms": 1000 * statistics.median(times),
        "saved_mib": _saved_bytes(fn) / 2**20,
        "peak_mib": max(peak, 0) / 2**20,
    }


def kernel_rows(seq: int, reps: int) -> list[tuple]:
    """Each kernel at level 0 and level 1 on Qwen2.5-like shapes (runs in one rank)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from anyspeed.features.ops.attention import SDPAttention
    from anyspeed.features.ops.cross_entropy import vocab_parallel_cross_entropy
    from anyspeed.features.ops.rope import apply_rope
    from anyspeed.features.ops.swiglu import swiglu

    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # Megatron's attention forks the RNG
    torch.manual_seed(0)
    b, heads, groups, d, hidden, ffn, vocab = 1, 8, 2, 64, 512, 1408, 32000
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
    )
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ref_attn, new_attn = DotProductAttention(**kw), SDPAttention(**kw)
    q = torch.randn(seq, b, heads, d, requires_grad=True)
    k = torch.randn(seq, b, groups, d, requires_grad=True)
    v = torch.randn(seq, b, groups, d, requires_grad=True)
    x = torch.randn(seq * b, 2 * ffn, requires_grad=True)
    t = torch.randn(seq, b, heads, d, requires_grad=True)
    freqs = torch.randn(seq, 1, 1, d)
    logits = torch.randn(seq, b, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (seq, b))

    def glu(z):
        a, c = z.chunk(2, dim=-1)
        return F.silu(a) * c

    cases = [
        (
            "attention (causal, GQA 8/2)",
            lambda: ref_attn(q, k, v, None, AttnMaskType.causal),
            lambda: new_attn(q, k, v, None, AttnMaskType.causal),
        ),
        ("SwiGLU", lambda: glu(x), lambda: swiglu(x)),
        ("RoPE", lambda: _apply_rotary_pos_emb_bshd(t, freqs), lambda: apply_rope(t, freqs)),
        (
            "cross-entropy (vocab 32k)",
            lambda: tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels),
            lambda: vocab_parallel_cross_entropy(logits, labels),
        ),
    ]
    rows = []
    for name, old, new in cases:
        rows.append((name, _measure(old, reps), _measure(new, reps)))
    return rows


# ------------------------------------------------------------------------------------ part 2
def e2e(seq: int, steps: int, bf16: bool) -> dict:
    import torch.distributed as dist

    from anyspeed.device import cpu_cuda
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer
    from anyspeed.training.synthetic import train_step

    model = ModelConfig(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=1408,
        vocab_size=32000,
        add_qkv_bias=True,
        rotary_base=1000000,
    )
    cfg = TrainConfig(seq_length=seq, micro_batch_size=1, global_batch_size=2, bf16=bf16)
    trainer = Trainer(model, Layout(), cfg, PretrainTask())
    params = sum(p.numel() for p in trainer.model[0].parameters())
    train_step(trainer)  # warm-up
    cpu_cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    losses = [train_step(trainer)["loss"] for _ in range(steps)]
    dist.barrier()
    dt = (time.perf_counter() - t0) / steps
    return {
        "tokens_per_s": 2 * seq / dt,
        "peak_rss_mib": cpu_cuda.max_memory_allocated() / 2**20,
        "params": params,
        "loss": losses[-1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    a = p.parse_args()
    if not a.skip_kernels:
        # Level 0 in the measuring process: Megatron's own classes stay unpatched there.
        rows = run_distributed(
            kernel_rows,
            1,
            timeout=900,
            argv=["--optimization-level", "0"],
            seq=a.seq_length,
            reps=a.reps,
        )[0]
        print(f"per kernel, forward+backward, seq {a.seq_length}, fp32, 1 process")
        print(
            f"{'kernel':<28} {'L0 ms':>8} {'L1 ms':>8} {'speed-up':>8}   "
            f"{'saved MiB L0/L1':>16}   {'peak MiB L0/L1':>15}"
        )
        for name, old, new in rows:
            print(
                f"{name:<28} {old['ms']:>8.1f} {new['ms']:>8.1f} {old['ms'] / new['ms']:>7.2f}x"
                f"   {old['saved_mib']:>7.1f} / {new['saved_mib']:<7.1f}"
                f"   {old['peak_mib']:>6.0f} / {new['peak_mib']:<6.0f}"
            )
    if not a.skip_e2e:
        runs = {
            "level 0, fp32": (["--optimization-level", "0"], False),
            "level 1, fp32": (["--optimization-level", "1"], False),
            "level 1, bf16": (["--optimization-level", "1"], True),
        }
        res = {}
        for name, (argv, bf16) in runs.items():
            out = run_distributed(
                e2e, 2, timeout=1200, argv=argv, seq=a.seq_length, steps=a.steps, bf16=bf16
            )
            res[name] = out
        params = res["level 0, fp32"][0]["params"]
        print(
            f"\nend to end: Qwen2.5-architecture GPT, {params / 1e6:.0f}M parameters, seq "
            f"{a.seq_length}, DP2 on 2 CPU processes, micro-batch 1"
        )
        base = res["level 0, fp32"]
        print(f"{'run':<16} {'tokens/s':>9} {'vs L0':>7} {'peak RSS/rank MiB':>18} {'vs L0':>7}")
        for name, out in res.items():
            tps = out[0]["tokens_per_s"]
            rss = max(r["peak_rss_mib"] for r in out)
            base_rss = max(r["peak_rss_mib"] for r in base)
            print(
                f"{name:<16} {tps:>9.0f} {tps / base[0]['tokens_per_s']:>6.2f}x "
                f"{rss:>18.0f} {rss / base_rss:>6.2f}x"
            )


if __name__ == "__main__":
    main()
