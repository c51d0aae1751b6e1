"""The Qwen2.5-VL tower on a batch of images: one input at a time (what the tower does) vs the
whole batch under one block-diagonal mask (what it did before), side by side in one run.

Inputs never attend to each other, so the whole-batch path spends attention on (sum n)^2 pairs
and keeps (sum n)^2 scores per head for backward, where one input at a time needs sum(n^2). It
prints forward + backward time (best of ``--repeats``), the bytes autograd saves for backward
(unique storages) and the speed and memory ratios. The tower: Qwen2.5-VL-shaped but narrow
(hidden 256, 4 layers, 4 heads, windows of 112 px, layer 3 full), fp32, on the CPU.

    python benchmarks/qwen_vl_tower.py [--images 4] [--side 448] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch


def saved_bytes(fn) -> int:
    """Bytes of the unique storages autograd keeps for the backward of ``fn()``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn().sum().backward()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--side", type=int, default=448, help="image side in pixels (default 448)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from anyspeed.convert.megatron_io import megatron_session
    from anyspeed.models.qwen_vl.config import TowerConfig
    from anyspeed.models.qwen_vl.tower import QwenVisionTower, tower_transformer_config

    with megatron_session():
        torch.manual_seed(0)
        cfg = TowerConfig("qwen2_5_vl", 256, 4, 4, 512, 512, window_size=112,
                          fullatt_block_indexes=(3,))  # fmt: skip
        tower = QwenVisionTower(cfg, tower_transformer_config(cfg))
        g = a.side // cfg.patch_size
        grid = torch.tensor([[1, g, g]] * a.images)
        pixels = torch.randn(a.images * g * g, cfg.patch_dim)
        per_input = lambda: tower(pixels, grid)  # noqa: E731
        whole = lambda: tower._one(pixels, grid)  # noqa: E731
        with torch.no_grad():
            diff = float((per_input() - whole()).abs().max())
        t_one, t_all = best(per_input, a.repeats), best(whole, a.repeats)
        m_one, m_all = saved_bytes(per_input), saved_bytes(whole)
    n = a.images * g * g
    print(f"{a.images} images of {a.side}x{a.side} px = {n} patches, {a.threads} threads, fp32")
    print(f"one input at a time: {t_one * 1e3:8.1f} ms fwd+bwd, {m_one / 2**20:8.1f} MiB saved")
    print(f"whole batch masked:  {t_all * 1e3:8.1f} ms fwd+bwd, {m_all / 2**20:8.1f} MiB saved")
    print(f"speed-up {t_all / t_one:.2f}x, saved memory {m_all / m_one:.2f}x less; "
          f"outputs differ by {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
