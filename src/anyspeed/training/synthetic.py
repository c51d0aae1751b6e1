"""Deterministic synthetic token batches: every layout sees the same global batch per step.

The parity tests and benchmarks train on these, so a layout's losses can be compared with a
single process's. Tokens follow a learnable rule (each next token is a fixed function of the
previous one, with noise), so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import torch

from anyspeed.training.config import TrainConfig


def synthetic_batch(vocab_size: int, cfg: TrainConfig, step: int) -> torch.Tensor:
    """The global batch of step ``step``: [global_batch, seq+1] tokens, identical on all ranks."""
    g = torch.Generator().manual_seed(cfg.data_seed * 1000003 + step)
    n, s, v = cfg.global_batch_size, cfg.seq_length + 1, vocab_size
    start = torch.randint(0, v, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(s)) % v
    noise = torch.rand(n, s, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, v, (n, s), generator=g), tokens)


def microbatches(vocab_size: int, cfg: TrainConfig, step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of step ``step`` (its data-parallel share, its CP chunks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from anyspeed.device import torch_device

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = cfg.global_batch_size // dp
    mine = synthetic_batch(vocab_size, cfg, step)[rank * per_rank : (rank + 1) * per_rank]
    dev = torch_device()
    out = []
    for i in range(0, per_rank, cfg.micro_batch_size):
        mb = mine[i : i + cfg.micro_batch_size]
        batch = {
            "tokens": mb[:, :-1].contiguous().to(dev),
            "labels": mb[:, 1:].contiguous().to(dev),
            "position_ids": torch.arange(cfg.seq_length, device=dev).expand(mb.shape[0], -1),
        }
        out.append(get_batch_on_this_cp_rank(batch))  # Megatron's load-balanced CP split
    return out


def train_step(trainer) -> dict:
    """One optimizer step of ``trainer`` on the synthetic batch of its current iteration."""
    return trainer.step(
        microbatches(trainer.model_config.vocab_size, trainer.cfg, trainer.iteration)
    )
