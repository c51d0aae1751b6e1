"""Device checks for a CUDA machine (run by hand where a GPU is lent; CI has none).

1. The context-parallel block kernels on CUDA (PyTorch's memory-efficient attention, which
   returns and accepts the log-sum-exp) against the plain-math path, and a two-block ring step
   (partials merged by log-sum-exp, gradients per block) against SDPA over the whole sequence.
2. ``anyspeed pretrain`` on one GPU (nccl, bf16, mock data): the loss must fall.
3. The tiny Qwen3-MoE run with the all-to-all dispatcher and grouped GEMM (issue 14), tokens/s.
4. ``--swap-attention``: lower peak device memory, bit-equal losses (issue 16).
5. The lean one-token decode step on this device against Megatron's forward, every layer kind
   of ``tests/helpers/decode_ranks.py`` (fp32 within 1e-4, bf16 within 5e-2; issue 18).
6. FP8 without Transformer Engine: ``torch._scaled_mm`` (the GEMM on FP8 tensor cores) equals
   the emulated GEMM the CPU tests check, for each operand pairing; then ``anyspeed pretrain
   --fp8-format hybrid`` trains.

    PYTHONPATH=src python scripts/gpu_check.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F


def block_kernels() -> bool:
    from anyspeed.features.context_parallel import attention_math as M

    ok = True
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-4)):
        for h, hkv, sq, sk, causal in (
            (8, 8, 256, 256, True),
            (8, 2, 256, 128, False),
            (8, 1, 100, 300, False),
            (4, 2, 96, 96, True),
        ):
            q = torch.randn(2, h, sq, 64, device=dev, generator=g).to(dtype)
            k = torch.randn(2, hkv, sk, 64, device=dev, generator=g).to(dtype)
            v = torch.randn(2, hkv, sk, 64, device=dev, generator=g).to(dtype)
            do = torch.randn(2, h, sq, 64, device=dev, generator=g).to(dtype)
            M.FUSED = True
            assert M._fused(q) == "cuda"
            fo, fl = M.partial_attention(q, k, v, 0.125, causal)
            fg = M.block_grads(q, k, v, do, fo, fl, 0.125, causal)
            M.FUSED = False
            mo, ml = M.partial_attention(q, k, v, 0.125, causal)
            mg = M.block_grads(q, k, v, do, mo, ml, 0.125, causal)
            pairs = zip((fo, fl, *fg), (mo, ml, *mg), strict=True)
            diffs = [float((a - b).abs().max()) for a, b in pairs]
            good = all(d == d for d in diffs) and max(diffs) <= tol  # d == d: not NaN
            ok &= good
            print(
                f"block {str(dtype):15} h={h} hkv={hkv} sq={sq} sk={sk} causal={causal}: "
                f"max diff out/lse/dq/dk/dv {[f'{d:.1e}' for d in diffs]} "
                f"{'OK' if good else 'FAIL'}",
                flush=True,
            )
    # A two-block ring step in fp32: queries = the second half, keys = both halves.
    M.FUSED = True
    s, c = 512, 256
    q = torch.randn(1, 8, s, 64, device=dev, generator=g, requires_grad=True)
    k = torch.randn(1, 2, s, 64, device=dev, generator=g, requires_grad=True)
    v = torch.randn(1, 2, s, 64, device=dev, generator=g, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    do = torch.randn_like(ref)
    ref.backward(do)
    qb, dob = q[:, :, c:].detach(), do[:, :, c:]
    o0, l0 = M.partial_attention(qb, k[:, :, :c].detach(), v[:, :, :c].detach(), 0.125, False)
    o1, l1 = M.partial_attention(qb, k[:, :, c:].detach(), v[:, :, c:].detach(), 0.125, True)
    out, lse = M.merge(o0, l0, o1, l1)
    g0 = M.block_grads(qb, k[:, :, :c].detach(), v[:, :, :c].detach(), dob, out, lse, 0.125, False)
    g1 = M.block_grads(qb, k[:, :, c:].detach(), v[:, :, c:].detach(), dob, out, lse, 0.125, True)
    d_out = float((out - ref[:, :, c:]).abs().max())
    d_dq = float((g0[0] + g1[0] - q.grad[:, :, c:]).abs().max())
    # keys of the first half also get gradient from the first half's queries: compare the
    # second-half keys only (they see only the second-half queries).
    d_dk = float((g1[1] - k.grad[:, :, c:]).abs().max())
    good = max(d_out, d_dq, d_dk) <= 1e-4
    ok &= good
    print(
        f"ring step fp32 vs SDPA: out {d_out:.1e} dq {d_dq:.1e} dk {d_dk:.1e} "
        f"{'OK' if good else 'FAIL'}",
        flush=True,
    )
    return ok


SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--num-query-groups", "2", "--ffn-hidden-size", "704", "--seq-length", "512",
         "--max-position-embeddings", "512", "--micro-batch-size", "8",
         "--global-batch-size", "16", "--lr", "3e-3", "--mock-data", "--eval-iters", "2",
         "--no-progress-bar", "--distributed-backend", "nccl"]  # fmt: skip


def _pretrain(*flags: str, metrics: str | None = None) -> str | None:
    """``anyspeed pretrain`` on this GPU; its output, or None (printed) when it failed."""
    cmd = [sys.executable, "-m", "anyspeed.cli", "pretrain", *SMALL, *flags]
    if metrics:
        cmd += ["--metrics-file", metrics]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    print(out.stdout[-3000:], flush=True)
    if out.returncode:
        print(out.stderr[-4000:], flush=True)
        return None
    return out.stdout


def pretrain() -> bool:
    out = _pretrain("--model", "tiny-qwen2.5", "--train-iters", "60", "--bf16",
                    "--log-interval", "20", "--eval-interval", "60")  # fmt: skip
    return out is not None and "lm loss" in out


def moe() -> bool:
    """Issue 14: the tiny Qwen3-MoE run on CUDA with the all-to-all dispatcher and grouped
    GEMM (fp32 and bf16); tokens/s is in the printed iteration lines."""
    ok = True
    for dtype in ([], ["--bf16"]):
        out = _pretrain("--model", "tiny-qwen3-moe", "--moe-token-dispatcher-type", "alltoall",
                        "--moe-grouped-gemm", "--moe-aux-loss-coeff", "0.01",
                        "--train-iters", "60", "--log-interval", "20", "--eval-interval", "60",
                        *dtype)  # fmt: skip
        ok &= out is not None and "expert load" in out
    print(f"moe alltoall + grouped GEMM: {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def swap_attention() -> bool:
    """Issue 16: --swap-attention lowers peak device memory with bit-equal losses."""
    import json
    import tempfile

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in (("off", []), ("on", ["--swap-attention"])):
            path = os.path.join(tmp, f"{name}.jsonl")
            if _pretrain("--model", "tiny-qwen2.5", "--train-iters", "10", "--log-interval", "1",
                         "--eval-interval", "100", *flags, metrics=path) is None:  # fmt: skip
                return False
            rows[name] = [json.loads(line) for line in open(path)]
    same = [r["lm_loss"] for r in rows["off"]] == [r["lm_loss"] for r in rows["on"]]
    peak = {k: max(r["peak_mem_gib"] for r in v) for k, v in rows.items()}
    ok = same and peak["on"] < peak["off"]
    print(f"swap-attention: losses bit-equal {same}, peak {peak['off']:.3f} -> "
          f"{peak['on']:.3f} GiB {'OK' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return ok


def decode() -> bool:
    """Issue 18: the lean decode step's logits against Megatron's forward on this device."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from anyspeed.testing import run_distributed
    from helpers import decode_ranks

    res = run_distributed(decode_ranks.lean_vs_megatron, 1, layouts=[(1, 1)], steps=8,
                          timeout=900)[0]  # fmt: skip
    ok = True
    for key, (lean, megatron, calls) in ((k, v) for k, v in res.items() if isinstance(k, tuple)):
        diff = max(float((a - b).abs().max()) for a, b in zip(lean, megatron, strict=True))
        good = diff < (5e-2 if key[1] == "bf16" else 1e-4)
        ok &= good
        print(f"lean decode {key[1]:<22} max |diff| {diff:.2e}, lean steps {calls} "
              f"{'OK' if good else 'FAIL'}", flush=True)  # fmt: skip
    return ok


def fp8() -> bool:
    """FP8 GEMMs: the tensor-core path equals the emulated one (fp32 sums of exact products)."""
    from anyspeed.features.fp8 import numerics as n

    ok = True
    if torch.cuda.get_device_capability() < (8, 9):
        print("fp8: no FP8 tensor cores here (compute capability < 8.9): emulated", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for ta, tb in ((n.E4M3, n.E4M3), (n.E5M2, n.E4M3)):
        a, b = (torch.randn(256, 512, device="cuda", generator=g) for _ in range(2))
        sa, sb = torch.tensor(40.0, device="cuda"), torch.tensor(60.0, device="cuda")
        qa, qb = n.quantize(a, ta, sa), n.quantize(b, tb, sb)
        fast = n.mm(qa, sa, qb, sb, torch.float32)
        slow = (qa.float() @ qb.float().t()) / (sa * sb)
        diff = float((fast - slow).abs().max() / slow.abs().max())
        good = n._scaled_mm_fits(qa, qb) and diff < 1e-5
        ok &= good
        print(f"fp8 _scaled_mm {ta} x {tb}: rel. diff {diff:.1e} {'OK' if good else 'FAIL'}")
    out = _pretrain("--model", "tiny-qwen2.5", "--train-iters", "40", "--bf16", "--fp8-format",
                    "hybrid", "--fp8-recipe", "tensorwise", "--log-interval", "20",
                    "--eval-interval", "40")  # fmt: skip
    ok &= out is not None and "lm loss" in out
    print(f"fp8 pretrain: {'OK' if ok else 'FAIL'}", flush=True)
    return ok


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    results = [block_kernels(), pretrain(), moe(), swap_attention(), decode(), fp8()]
    print("GPU CHECK", "PASSED" if all(results) else "FAILED", flush=True)
    sys.exit(0 if all(results) else 1)
