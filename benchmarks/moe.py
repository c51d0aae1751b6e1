"""MoE benchmarks, side by side in one run.

Part 1, expert MLP (1 process, forward + backward): Megatron's ``SequentialMLP`` (one MLP per
expert) against ``GroupedMLP`` through anyspeed's grouped matmul, at 8 and 64 experts: routed
tokens/s and the growth of peak allocated memory.
Part 2, a small MoE GPT on 2 processes at EP2: tokens/s of the allgather and alltoall token
dispatchers, with sequential and grouped experts.

    python benchmarks/moe.py [--tokens 4096] [--hidden 256] [--ffn 512] [--reps 3] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from anyspeed.testing import run_distributed


def _expert_layer(experts: int, hidden: int, ffn: int, grouped: bool):
    from megatron.core.transformer.spec_utils import build_module

    from anyspeed.models import gpt
    from anyspeed.models.config import ModelConfig

    model = ModelConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn,
                        num_attention_heads=4, num_experts=experts, moe_router_topk=2,
                        moe_grouped_gemm=grouped)  # fmt: skip
    config = gpt.transformer_config(model)
    spec = gpt.layer_spec(model, config)
    return build_module(spec.layer_specs[0].submodules.mlp, config=config, layer_number=1)


def expert_rows(tokens: int, hidden: int, ffn: int, reps: int) -> list[dict]:
    """Sequential vs grouped experts: forward + backward of the whole MoE layer (one rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from anyspeed.device import cpu_cuda

    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    rows = []
    for experts in (8, 64):
        for grouped in (False, True):
            layer = _expert_layer(experts, hidden, ffn, grouped)
            x = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(0))
            x.requires_grad_()

            def step(layer=layer, x=x):
                out, _ = layer(x)
                out.sum().backward()

            step()  # warm-up
            cpu_cuda.reset_peak_memory_stats()
            base = cpu_cuda.memory_allocated()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            rows.append({
                "experts": experts, "grouped": grouped,
                "tokens_per_s": tokens / statistics.median(times),
                "peak_mib": max(cpu_cuda.max_memory_allocated() - base, 0) / 2**20,
            })  # fmt: skip
    return rows


def e2e_rows(steps: int) -> list[dict]:
    """A 4-layer MoE GPT at EP2: tokens/s per (dispatcher, experts kind), one process group."""
    from anyspeed import adaptor
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training import synthetic
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer

    rows = []
    for dispatcher in ("allgather", "alltoall"):
        for grouped in (False, True):
            adaptor.undo()
            adaptor.apply(argv=[])
            model = ModelConfig(
                num_layers=4,
                hidden_size=256,
                ffn_hidden_size=512,
                num_attention_heads=8,
                vocab_size=1024,
                num_experts=16,
                moe_router_topk=2,
                moe_aux_loss_coeff=1e-2,
                moe_token_dispatcher_type=dispatcher,
                moe_grouped_gemm=grouped,
            )
            cfg = TrainConfig(seq_length=256, micro_batch_size=4, global_batch_size=16)
            t = Trainer(model, Layout(ep=2), cfg, PretrainTask())
            synthetic.train_step(t)  # warm-up
            t0 = time.perf_counter()
            for _ in range(steps):
                synthetic.train_step(t)
            dt = (time.perf_counter() - t0) / steps
            rows.append(
                {
                    "dispatcher": dispatcher,
                    "grouped": grouped,
                    "tokens_per_s": cfg.global_batch_size * cfg.seq_length / dt,
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip-e2e", action="store_true")
    a = p.parse_args()
    from anyspeed import quiet

    quiet.install()
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    rows = run_distributed(expert_rows, 1, tokens=a.tokens, hidden=a.hidden, ffn=a.ffn,
                           reps=a.reps, timeout=1800)[0]  # fmt: skip
    print(f"\nMoE layer, {a.tokens} tokens, hidden {a.hidden}, expert FFN {a.ffn}, top-2, fp32")
    print(f"{'experts':>8} {'kind':>11} {'tokens/s':>10} {'peak MiB':>9} {'vs seq':>7}")
    for r in rows:
        seq = next(x for x in rows if x["experts"] == r["experts"] and not x["grouped"])
        kind = "grouped" if r["grouped"] else "sequential"
        print(f"{r['experts']:>8} {kind:>11} {r['tokens_per_s']:>10,.0f} {r['peak_mib']:>9.1f} "
              f"{r['tokens_per_s'] / seq['tokens_per_s']:>6.2f}x")  # fmt: skip
    if a.skip_e2e:
        return
    rows = run_distributed(e2e_rows, 2, steps=a.steps, timeout=1800)[0]
    print("\nMoE GPT (4 layers, hidden 256, 16 experts top-2, seq 256), EP2 on 2 processes")
    for r in rows:
        kind = "grouped" if r["grouped"] else "sequential"
        print(f"{r['dispatcher']:>10} {kind:>11} {r['tokens_per_s']:>10,.0f} tokens/s")


if __name__ == "__main__":
    main()
