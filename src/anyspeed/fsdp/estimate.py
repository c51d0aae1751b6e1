"""Per-rank memory of ``anyspeed fsdp2`` before start, and the FLOPs per token its log line
divides by: counted from the model built on the meta device (no weights are read).

Sharded state is exact: each rank keeps 1/N of the fp32 parameters, of the gradients of the
trainable ones and of AdamW's two moments. Gathered parameters are bounded by the largest
wrapped block in ``param_dtype``, twice (the block computing and the next one prefetched).
Activations depend on the data and are not included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.fsdp.config import FSDPConfig

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Estimate:
    parameters: int  # every parameter, all ranks together
    trainable: int
    params_bytes: int  # per rank, sharded fp32
    grads_bytes: int
    optimizer_bytes: int
    gathered_bytes: int  # two largest-block all-gathers in param_dtype

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.gathered_bytes

    def line(self, world: int) -> str:
        gib = 2**30
        return (
            f"{self.parameters / 1e6:,.1f}M parameters ({self.trainable / 1e6:,.1f}M trainable) "
            f"over {world} ranks: per rank {self.params_bytes / gib:.2f} GiB parameters + "
            f"{self.grads_bytes / gib:.2f} gradients + {self.optimizer_bytes / gib:.2f} "
            f"optimizer + {self.gathered_bytes / gib:.2f} gathered blocks = "
            f"{self.total_bytes / gib:.2f} GiB before activations"
        )


def _shard(p: torch.Tensor, world: int) -> int:
    """Elements one rank holds of parameter ``p``: FSDP2 splits dim 0 into ``world`` equal
    (padded) chunks."""
    if p.dim() == 0:
        return 1
    return -(-p.shape[0] // world) * (p.numel() // max(p.shape[0], 1))


def estimate(model: torch.nn.Module, cfg: FSDPConfig, world: int) -> Estimate:
    """The estimate for ``model`` (meta or real, frozen as configured) at ``world`` ranks."""
    from anyspeed.fsdp.model import blocks

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    largest = max(
        (
            sum(p.numel() for p in m.parameters())
            for _, m in blocks(model, cfg.parallel.fsdp_modules)
        ),
        default=0,
    )
    shard_all = sum(_shard(p, world) for p in params)
    shard_trainable = sum(_shard(p, world) for p in params if p.requires_grad)
    return Estimate(
        parameters=total,
        trainable=trainable,
        params_bytes=4 * shard_all,
        grads_bytes=4 * shard_trainable,
        optimizer_bytes=8 * shard_trainable,
        gathered_bytes=2 * largest * BYTES[cfg.parallel.param_dtype],
    )


def flops_per_token(model: torch.nn.Module, cfg: FSDPConfig) -> float:
    """Training FLOPs per token: 6 per weight of the matrix products (2 forward, 4 backward;
    frozen weights 4: no weight gradient) plus causal attention's scores and mixing."""
    from anyspeed.fsdp.model import language_config

    dense = frozen = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:
            continue  # the embedding is a lookup, not a product
        if p.requires_grad:
            dense += p.numel()
        else:
            frozen += p.numel()
    text: Any = language_config(model.config)
    layers = getattr(text, "num_hidden_layers", 0)
    heads = getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // max(heads, 1)
    attention = 6 * layers * heads * head_dim * cfg.data.cutoff_len  # 12 * s / 2 (causal)
    return 6.0 * dense + 4.0 * frozen + attention
