"""Rank functions for the device-layer tests (spawned, so importable by name)."""

from __future__ import annotations

import torch


def gloo_avg_and_backend() -> dict:
    """nccl is asked for; AVG is used synchronously and asynchronously."""
    import torch.distributed as dist

    dist.init_process_group(backend="nccl")  # mapped to gloo on the CPU
    rank = dist.get_rank()
    sub = dist.new_group(ranks=[0, 1], backend="nccl")
    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    y = torch.arange(4, dtype=torch.float32) * (rank + 1)
    out = torch.empty(2)
    work = dist.reduce_scatter_tensor(out, y, op=dist.ReduceOp.AVG, group=sub, async_op=True)
    work.wait()
    z = torch.full((3,), float(rank), dtype=torch.bfloat16)
    dist.all_reduce(z)  # bf16 through gloo
    dist.barrier(device_ids=[torch.cuda.current_device()])
    return {
        "backend": dist.get_backend(),
        "sub": dist.get_backend(sub),
        "avg": x.tolist(),
        "rs": out.tolist(),
        "bf16": z.float().tolist(),
    }


def pipeline_ring_exchange() -> list:
    """PP=2 ring: both ranks send an activation 'next' and a gradient 'prev' in one batch."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    act = torch.full((4,), 10.0 + rank)  # activation travelling forward
    grad = torch.full((4,), 20.0 + rank)  # gradient travelling backward
    recv_prev, recv_next = torch.empty(4), torch.empty(4)
    reqs = p2p._batched_p2p_ops(
        tensor_send_prev=grad,
        tensor_recv_prev=recv_prev,
        tensor_send_next=act,
        tensor_recv_next=recv_next,
        group=dist.group.WORLD,
        prev_pipeline_rank=peer,
        next_pipeline_rank=peer,
    )
    for r in reqs:
        r.wait()
    return [recv_prev.tolist(), recv_next.tolist()]
