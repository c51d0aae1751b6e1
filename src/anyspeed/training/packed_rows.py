"""Micro-batches whose model reads one packed ``thd`` sequence while their per-token tensors
stay padded rows [b, s] (MindSpeed-RL's remove-padding): the sequences are laid end to end, the
model computes no padding, and its per-token outputs are put back in the rows the losses read.

A packed micro-batch carries, beside its padded tensors:

- ``packed_tokens``, ``packed_labels``, ``packed_position_ids`` [1, T]: the rows' real tokens in
  order, then a tail of padding up to T (its own attention segment);
- ``cu_seqlens`` [n + 2] (int32): where each row's sequence (and the tail) starts and ends;
- ``packed_rows`` [T_real]: each real token's place ``row * s + column`` in the padded rows.
"""

from __future__ import annotations

from typing import Any

import torch

KEYS = ("packed_tokens", "packed_labels", "packed_position_ids", "cu_seqlens", "packed_rows")


def is_packed(b: dict[str, Any]) -> bool:
    """Whether micro-batch ``b`` carries packed model inputs."""
    return "packed_rows" in b


def pack(b: dict[str, Any], lengths: list[int], length: int) -> None:
    """Add the packed model inputs of ``b``'s padded ``tokens``/``labels`` [n, s], whose row i
    holds ``lengths[i]`` real tokens, laid out as one sequence of ``length`` tokens."""
    tokens, labels = b["tokens"], b["labels"]
    s, total = tokens.shape[1], sum(lengths)
    if total > length:
        raise ValueError(f"{total} tokens do not fit a packed sequence of {length}")
    rows = torch.cat([i * s + torch.arange(n) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(length - total)])
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    if total < length:
        bounds.append(length)  # the padding tail: a segment of its own
    device = tokens.device
    rows = rows.to(device)

    def laid(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(1, length, dtype=x.dtype, device=device)
        out[0, :total] = x.reshape(-1)[rows]
        return out

    b["packed_tokens"], b["packed_labels"] = laid(tokens), laid(labels)
    b["packed_position_ids"] = pos[None].to(device)
    b["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
    b["packed_rows"] = rows


def model_inputs(b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(tokens, position_ids, labels, packed_seq_params) the model reads for micro-batch ``b``:
    its packed sequence when it has one, else its padded rows."""
    from anyspeed.models.logprobs import packed_params

    if not is_packed(b):
        return b["tokens"], b["position_ids"], b["labels"], packed_params(b)
    return b["packed_tokens"], b["packed_position_ids"], b["packed_labels"], packed_params(b)


def to_rows(x: torch.Tensor, b: dict[str, Any], dim: int = -1) -> torch.Tensor:
    """A per-token output of a packed micro-batch (``dim`` of size T, after a batch dim of 1)
    as the padded rows [..., n, s, ...] (zero at padding), differentiably; ``x`` unchanged for
    a padded micro-batch."""
    if not is_packed(b):
        return x
    n, s = b["tokens"].shape
    dim = dim % x.dim()
    rows = b["packed_rows"]
    real = x.squeeze(dim - 1).narrow(dim - 1, 0, rows.numel())
    shape = list(real.shape)
    shape[dim - 1] = n * s
    out = real.new_zeros(shape).index_copy(dim - 1, rows, real)
    return out.unflatten(dim - 1, (n, s))


def to_packed(x: torch.Tensor, b: dict[str, Any]) -> torch.Tensor:
    """Padded rows [n, s, ...] of micro-batch ``b`` laid out as its packed sequence
    [1, T, ...] (zero in the tail); ``x`` unchanged for a padded micro-batch."""
    if not is_packed(b):
        return x
    rows, length = b["packed_rows"], b["packed_tokens"].shape[1]
    flat = x.reshape(-1, *x.shape[2:])[rows]
    out = flat.new_zeros(length, *x.shape[2:])
    out[: rows.numel()] = flat
    return out[None]


def schedule_shape(task: Any, cfg: Any, micro: list[dict[str, Any]]) -> tuple[int, int]:
    """(sequence length, micro-batch size) pipeline stages exchange for ``micro``: a packed
    micro-batch is one sequence of its own length (every micro-batch of a schedule call has the
    same one under pipeline parallelism), else the task's shape."""
    if micro and is_packed(micro[0]):
        return int(micro[0]["packed_tokens"].shape[1]), 1
    return task.schedule_shape(cfg.seq_length, cfg.micro_batch_size)


def token_count(b: dict[str, Any]) -> int:
    """Token positions the model computes for micro-batch ``b`` (packed or padded)."""
    return int((b["packed_tokens"] if is_packed(b) else b["tokens"]).numel())
