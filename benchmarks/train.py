"""``anyspeed pretrain`` vs Hugging Face transformers + torch DDP, side by side in one run.

Model: the issue's tiny Qwen2.5 (8 layers, hidden 512, 8 heads, 2 KV groups, FFN 1408, vocab
32k, ~55M parameters), sequence 1024, micro batch 4, 2 CPU processes (data parallel), random
tokens, AdamW. For fp32 and bf16 it prints tokens/s, peak RSS per rank and MFU (against the
device layer's measured matmul peak) for:

- transformers ``Qwen2ForCausalLM`` (SDPA attention) under ``DistributedDataParallel``;
- plain Megatron-Core (local layer spec) = ``anyspeed pretrain --optimization-level 0``;
- ``anyspeed pretrain`` at its default level (2) with the distributed optimizer.

    python benchmarks/train.py [--iters 6] [--warmup 2] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

from anyspeed.testing import run_distributed

SEQ, MBS, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 1024, 4, 8, 512, 8, 2, 1408, 32000


def flops_per_token() -> float:
    from anyspeed.models import ModelConfig

    model = ModelConfig(hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HEADS,
                        num_query_groups=GROUPS, ffn_hidden_size=FFN, vocab_size=VOCAB)  # fmt: skip
    return model.flops_per_token(SEQ)


# ------------------------------------------------------------------------- transformers + DDP
def hf_rank(iters: int, warmup: int, bf16: bool) -> dict:
    """One DDP rank: Qwen2ForCausalLM (SDPA) with AdamW on random tokens."""
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from anyspeed import adaptor

    adaptor.undo()  # the baseline runs on plain torch, nothing patched
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=GROUPS, max_position_embeddings=SEQ,
                      tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    if bf16:
        model = model.to(torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for i in range(warmup + iters):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        t0 = time.perf_counter()
        out = ddp(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"s_per_iter": sum(times) / len(times),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # fmt: skip


def run_hf(iters: int, warmup: int, bf16: bool) -> dict:
    ranks = run_distributed(hf_rank, 2, iters=iters, warmup=warmup, bf16=bf16, timeout=3600)
    s = max(r["s_per_iter"] for r in ranks)
    return {"tokens_per_s": 2 * MBS * SEQ / s,
            "peak_rss_gib": max(r["peak_rss_gib"] for r in ranks)}  # fmt: skip


# ------------------------------------------------------------------------- anyspeed pretrain
def run_anyspeed(iters: int, warmup: int, bf16: bool, level: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        cmd = [
            sys.executable, "-m", "anyspeed.cli", "pretrain", "--nproc-per-node", "2",
            "--model", "tiny-qwen2.5", "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
            "--num-attention-heads", str(HEADS), "--num-query-groups", str(GROUPS),
            "--ffn-hidden-size", str(FFN), "--padded-vocab-size", str(VOCAB),
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
            "--micro-batch-size", str(MBS), "--global-batch-size", str(2 * MBS),
            "--train-iters", str(warmup + iters), "--lr", "1e-4", "--mock-data",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--log-interval", "1", "--no-progress-bar", "--metrics-file", metrics,
            "--optimization-level", str(level),
            *(["--use-distributed-optimizer"] if level > 0 else []),
            *(["--bf16"] if bf16 else []),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        rows = [json.loads(line) for line in open(metrics)][warmup:]
    s = sum(r["ms_per_iter"] for r in rows) / len(rows) / 1000
    return {"tokens_per_s": 2 * MBS * SEQ / s, "peak_rss_gib": max(r["peak_mem_gib"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    args = p.parse_args()
    from anyspeed.device.flops import peak_flops

    fpt = flops_per_token()
    print(f"tiny Qwen2.5 ({LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}), seq {SEQ}, micro "
          f"batch {MBS}, 2 CPU processes, {args.iters} measured iterations after "
          f"{args.warmup} warm-up", flush=True)  # fmt: skip
    print(f"{'dtype':<6} {'run':<40} {'tokens/s':>9} {'vs HF':>6} {'peak RSS/rank':>14} "
          f"{'vs HF':>6} {'MFU':>6}")  # fmt: skip
    for dt in args.dtypes:
        bf16 = dt == "bf16"
        peak = peak_flops(torch.bfloat16 if bf16 else torch.float32)
        rows = [("transformers Qwen2ForCausalLM + DDP", run_hf(args.iters, args.warmup, bf16))]
        rows.append(("Megatron-Core local spec (level 0)",
                     run_anyspeed(args.iters, args.warmup, bf16, 0)))  # fmt: skip
        rows.append(("anyspeed level 2 + distributed optimizer",
                     run_anyspeed(args.iters, args.warmup, bf16, 2)))  # fmt: skip
        ref = rows[0][1]
        for name, r in rows:
            # MFU per process against one process's share of the machine's measured peak.
            mfu = "n/a" if peak is None else f"{100 * r['tokens_per_s'] * fpt / peak:.1f}%"
            speed = r["tokens_per_s"] / ref["tokens_per_s"]
            mem = r["peak_rss_gib"] / ref["peak_rss_gib"]
            print(f"{dt:<6} {name:<40} {r['tokens_per_s']:>9,.0f} {speed:>5.2f}x "
                  f"{r['peak_rss_gib']:>10.2f} GiB {mem:>5.2f}x {mfu:>6}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
