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


# the per-kernel shapes: heads, query groups, head dim, hidden, FFN, vocabulary
SHAPES = {
    "55m": (8, 2, 64, 512, 1408, 32000),  # part 2's model
    "qwen2.5-1.5b": (12, 2, 128, 1536, 8960, 151936),  # benchmarks/gpu.py's model
    "tiny": (4, 2, 16, 64, 128, 512),  # the fast test's
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _measure(fn, reps: int, dev: torch.device) -> dict:
    from anyspeed.device import cpu_cuda

    mem = torch.cuda if dev.type == "cuda" else cpu_cuda
    fn().float().sum().backward()  # warm-up (and, for a compiled kernel, its compilation)
    _sync(dev)
    times = []
    mem.reset_peak_memory_stats()
    base = mem.memory_allocated()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn().float().sum().backward()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    peak = mem.max_memory_allocated() - base
    return {
        "ms": 1000 * statistics.median(times),
        "saved_mib": _saved_bytes(fn) / 2**20,
        "peak_mib": max(peak, 0) / 2**20,
    }


def _compiled_rows(dev, x, logits, labels) -> list[tuple]:  # noqa: ANN001
    """On CUDA, where Megatron's fusions are torch.compile'd: the choices level 1 makes
    between them and anyspeed's eager kernels, timed (fused-swiglu takes Megatron's;
    fused-cross-entropy takes anyspeed's, which keeps no fp32 copy of the logits)."""
    from megatron.core import parallel_state as ps
    from megatron.core.fusions import fused_bias_swiglu, fused_cross_entropy

    from anyspeed.features.ops.cross_entropy import vocab_parallel_cross_entropy
    from anyspeed.features.ops.feature import fusions_compiled
    from anyspeed.features.ops.swiglu import swiglu

    if not fusions_compiled():
        return []
    tp = ps.get_tensor_model_parallel_group()
    fused_ce = fused_cross_entropy.fused_vocab_parallel_cross_entropy
    return [
        (
            "SwiGLU: anyspeed's eager | Megatron's compiled",
            lambda: swiglu(x),
            lambda: fused_bias_swiglu.bias_swiglu_impl(x, None),
        ),
        (
            "cross-entropy: anyspeed's | Megatron's compiled",
            lambda: vocab_parallel_cross_entropy(logits.clone(), labels),
            lambda: fused_ce(logits.clone(), labels, tp),
        ),
    ]


def kernel_rows(seq: int, reps: int, shape: str = "55m", dtype: str = "fp32") -> list[tuple]:
    """Each kernel at level 0 and level 1 (and, on CUDA, level 1's choices against Megatron's
    compiled fusions) at ``shape``; runs in one rank, on its device."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from anyspeed.device import torch_device
    from anyspeed.features.ops.attention import SDPAttention
    from anyspeed.features.ops.cross_entropy import vocab_parallel_cross_entropy
    from anyspeed.features.ops.rope import apply_rope

    dev = torch_device()
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # Megatron's attention forks the RNG
    torch.manual_seed(0)
    heads, groups, d, hidden, ffn, vocab = SHAPES[shape]
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bf16=dt == torch.bfloat16,
        params_dtype=dt,
    )
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ref_attn, new_attn = DotProductAttention(**kw), SDPAttention(**kw)

    def leaf(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=dev, dtype=dt).requires_grad_()

    q, k, v = leaf(seq, 1, heads, d), leaf(seq, 1, groups, d), leaf(seq, 1, groups, d)
    x, t, logits = leaf(seq, 2 * ffn), leaf(seq, 1, heads, d), leaf(seq, 1, vocab)
    freqs = torch.randn(seq, 1, 1, d, device=dev)
    labels = torch.randint(0, vocab, (seq, 1), device=dev)

    def glu(z):  # Megatron's MLP without bias_activation_fusion (level 0's portable config)
        a, c = z.chunk(2, dim=-1)
        return F.silu(a) * c

    causal, swiglu_l1 = AttnMaskType.causal, _level1_swiglu(dev)
    cases = [
        (
            "attention (causal, GQA)",
            lambda: ref_attn(q, k, v, None, causal),
            lambda: new_attn(q, k, v, None, causal),
        ),
        # level 1's SwiGLU entry on this device (on CUDA Megatron's compiled one)
        ("SwiGLU", lambda: glu(x), lambda: swiglu_l1(x, None)),
        ("RoPE", lambda: _apply_rotary_pos_emb_bshd(t, freqs), lambda: apply_rope(t, freqs)),
        (
            f"cross-entropy (vocab {vocab})",
            # both in place on their input: each gets a copy, so both time the same copy
            lambda: tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels),
            lambda: vocab_parallel_cross_entropy(logits.clone(), labels),
        ),
    ]
    cases += _compiled_rows(dev, x, logits, labels) if dev.type == "cuda" else []
    return [(name, _measure(old, reps, dev), _measure(new, reps, dev)) for name, old, new in cases]


def _level1_swiglu(dev: torch.device):  # noqa: ANN202
    """The SwiGLU entry level 1 runs on ``dev`` (the fused-swiglu feature's own choice)."""
    from megatron.core.fusions import fused_bias_swiglu

    from anyspeed.device import DeviceInfo
    from anyspeed.features.ops.feature import megatron_compiles
    from anyspeed.features.ops.swiglu import bias_swiglu

    info = DeviceInfo(dev.type, "", "")
    return fused_bias_swiglu.bias_swiglu_impl if megatron_compiles(info) else bias_swiglu


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


def print_kernels(seq: int, reps: int, shape: str, dtype: str) -> list[str]:
    """Part 1's table, printed and returned (a line per kernel)."""
    # Level 0 in the measuring process: Megatron's own classes stay unpatched there.
    rows = run_distributed(
        kernel_rows,
        1,
        timeout=900,
        argv=["--optimization-level", "0"],
        seq=seq,
        reps=reps,
        shape=shape,
        dtype=dtype,
    )[0]
    out = [
        f"per kernel, forward+backward, {shape} shapes, seq {seq}, {dtype}, 1 process on "
        f"{torch.device('cuda' if torch.cuda.is_available() else 'cpu').type}; A: level 0 "
        "(Megatron's), B: level 1, unless the row names its two",
        f"{'kernel':<48} {'A ms':>8} {'B ms':>8} {'A / B':>7}   {'saved MiB A/B':>16}   "
        f"{'peak MiB A/B':>15}",
    ]
    for name, old, new in rows:
        out.append(
            f"{name:<48} {old['ms']:>8.2f} {new['ms']:>8.2f} {old['ms'] / new['ms']:>6.2f}x"
            f"   {old['saved_mib']:>7.1f} / {new['saved_mib']:<7.1f}"
            f"   {old['peak_mib']:>6.0f} / {new['peak_mib']:<6.0f}"
        )
    print("\n".join(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--shape", choices=sorted(SHAPES), default="55m", help="part 1's shapes")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="part 1's dtype")
    a = p.parse_args()
    if not a.skip_kernels:
        print_kernels(a.seq_length, a.reps, a.shape, a.dtype)
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
