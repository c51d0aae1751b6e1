"""Rank functions for the device-layer tests (spawned, so importable by name)."""

from __future__ import annotations

import torch


def gloo_avg_and_backend() -> dict:
    """nccl is asked for; AVG is used synchronously and asynchronously."""
    import torch.distributed as dist

    dist.init_process_group(backend="nccl")  # mapped to gloo on the CPU
    rank = dist.get_rank()
    sub = dist.new_group(ranks=[0, 1], backend="nccl")
    # torch's helper calls distributed_c10d.new_group itself (Megatron's HyperCommGrid uses it).
    enum, _ = dist.new_subgroups_by_enumeration([[0, 1]], backend="nccl")
    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    y = torch.arange(4, dtype=torch.float32) * (rank + 1)
    out = torch.empty(2)
    work = dist.reduce_scatter_tensor(out, y, op=dist.ReduceOp.AVG, group=sub, async_op=True)
    work.wait()
    z = torch.full((3,), float(rank), dtype=torch.bfloat16)
    dist.all_reduce(z)  # bf16 through gloo
    dist.barrier(device_ids=[torch.cuda.current_device()])
    # Uneven list all-gather (rank r sends r + 1 rows) and list reduce-scatter (MoE, expert TP).
    parts = [torch.empty(i + 1, 2) for i in range(2)]
    dist.all_gather(parts, torch.full((rank + 1, 2), float(rank + 1)))
    rs_out = torch.empty(rank + 1)
    dist.reduce_scatter(rs_out, [torch.ones(1) * (rank + 1), torch.ones(2) * 10 * (rank + 1)])
    return {
        "backend": dist.get_backend(),
        "sub": dist.get_backend(sub),
        "enum": dist.get_backend(enum),
        "avg": x.tolist(),
        "rs": out.tolist(),
        "bf16": z.float().tolist(),
        "uneven": [p.tolist() for p in parts],
        "rs_list": rs_out.tolist(),
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


def attention_parity_all() -> dict:
    """Every (dtype, gqa, mask) case of :func:`attention_parity` in one process."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer import dot_product_attention

    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # Megatron's attention forks the RNG
    # The reference must be Megatron's own class (level 0 leaves it unpatched).
    ref_cls = dot_product_attention.DotProductAttention
    assert ref_cls.__module__ == "megatron.core.transformer.dot_product_attention", ref_cls
    return {
        (dtype, gqa, mask): attention_parity(dtype, gqa, mask)
        for dtype in ("fp32", "bf16")
        for gqa in (False, True)
        for mask in ("causal", "padding", "document", "sink", "window", "sink-window")
    }


def attention_parity(dtype: str, gqa: bool, mask_kind: str) -> dict:
    """anyspeed SDPAttention vs Megatron DotProductAttention: output and input-grad diffs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from anyspeed.features.ops.attention import SDPAttention

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    heads, groups, d, s, b = 8, (2 if gqa else 8), 16, 64, 2
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        bf16=dtype == "bf16",
        params_dtype=dt,
        masked_softmax_fusion=False,
        # GPT-OSS: a learnable sink per head, a causal window of 5 keys before the row
        softmax_type="learnable" if "sink" in mask_kind else "vanilla",
        window_size=(5, 0) if "window" in mask_kind else None,
    )
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ref, fast = DotProductAttention(**kw), SDPAttention(**kw)
    if ref.softmax_offset is not None:  # the same sinks in both, large enough to matter
        with torch.no_grad():
            ref.softmax_offset.copy_(torch.linspace(-2.0, 3.0, heads))
            fast.softmax_offset.copy_(ref.softmax_offset)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, d, generator=g).to(dt)
    k = torch.randn(s, b, groups, d, generator=g).to(dt)
    v = torch.randn(s, b, groups, d, generator=g).to(dt)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = None
    if mask_kind == "padding":  # second sample: last 20 positions are padding
        keep = causal.expand(b, 1, s, s).clone()
        keep[1, :, :, s - 20 :] = False
        mask = ~keep
    elif mask_kind == "document":  # --reset-attention-mask: documents of length 24, 24, 16
        doc = torch.tensor([0] * 24 + [1] * 24 + [2] * 16)
        keep = causal & (doc[:, None] == doc[None, :])
        mask = ~keep.expand(b, 1, s, s)
    rows = torch.ones(b, 1, s, 1)  # rows with at least one visible key
    if mask is not None:
        rows = (~mask).any(-1, keepdim=True).float()
    row_w = rows.squeeze(-1).squeeze(1).transpose(0, 1)[..., None]  # [s, b, 1]
    outs, grads = [], []
    for mod in (ref, fast):
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        out = mod(qi, ki, vi, mask, AttnMaskType.causal)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dt)
        ((out * w).float() * row_w).sum().backward()
        outs.append(out.float() * row_w)
        sink = [] if mod.softmax_offset is None else [mod.softmax_offset.grad.float()]
        grads.append([t.grad.float() for t in (qi, ki, vi)] + sink)
    grad_diff = max(float((a - c).abs().max()) for a, c in zip(grads[0], grads[1], strict=True))
    grad_mag = max(float(a.abs().max()) for a in grads[0])
    out_diff = float((outs[0] - outs[1]).abs().max())
    return {
        "out": out_diff,
        "grad": grad_diff,
        "out_rel": out_diff / float(outs[0].abs().max()),
        "grad_rel": grad_diff / grad_mag,
    }


def cross_entropy_parity(dtype: str) -> dict:
    """anyspeed chunked CE vs Megatron vocab_parallel_cross_entropy, at the world's TP size."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from anyspeed.features.ops import cross_entropy as ce

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    rank = ps.get_tensor_model_parallel_rank()
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    s, b, v = 40, 3, 96
    g = torch.Generator().manual_seed(3)
    full = torch.randn(s, b, v, generator=g) * 4
    labels = torch.randint(0, v, (s, b), generator=g)
    part = full.chunk(tp, dim=-1)[rank].to(dt)
    ce.CHUNK_ROWS = 16  # exercise several chunks
    res = {}
    for name, fn in (
        ("ref", lambda x: tensor_parallel.vocab_parallel_cross_entropy(x, labels)),
        (
            "new",
            lambda x: ce.vocab_parallel_cross_entropy(
                x, labels, ps.get_tensor_model_parallel_group()
            ),
        ),
    ):
        x = part.clone().requires_grad_()
        loss = fn(x.clone() if name == "ref" else x)  # Megatron's works in place on its input
        loss.float().sum().backward()
        res[name] = (loss.float().detach(), x.grad.float())
    return {
        "loss": float((res["ref"][0] - res["new"][0]).abs().max()),
        "grad": float((res["ref"][1] - res["new"][1]).abs().max()),
        "scale": float(res["ref"][0].abs().max()),  # the largest per-token loss
    }


def cp_attention_parity(algo: str, heads: int, kv_heads: int, seq: int, fused: bool = True) -> dict:
    """Context-parallel attention (ring / ulysses / hybrid) vs. single-device causal SDPA, fp32.

    ``fused=False`` runs the blockwise pieces in plain math instead of the CPU flash kernels.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    from anyspeed.features.context_parallel import attention_math

    attention_math.FUSED = fused
    from anyspeed.features.context_parallel.ring import ring_attention, split_load_balanced
    from anyspeed.features.context_parallel.ulysses import ulysses_attention

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, heads, seq, 8, generator=g)
    k = torch.randn(2, kv_heads, seq, 8, generator=g)
    v = torch.randn(2, kv_heads, seq, 8, generator=g)
    grad = torch.randn(2, heads, seq, 8, generator=g)
    scale = 8**-0.5
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=scale,
                                         enable_gqa=heads != kv_heads)  # fmt: skip
    ref.backward(grad)

    if algo == "ring":

        def shard(t):
            return split_load_balanced(t, 2, rank, world)

        fn = ring_attention
    elif algo == "hybrid":  # Ulysses degree 2 inside, ring across
        from anyspeed.features.context_parallel.hybrid import hybrid_attention

        ug, rg = hybrid_groups(2)

        def shard(t):  # Megatron's load-balanced split over the whole CP group
            return split_load_balanced(t, 2, rank, world)

        def fn(q_, k_, v_, scale_, _group):
            return hybrid_attention(q_, k_, v_, scale_, ug, rg)
    else:

        def shard(t):
            return t.chunk(world, dim=2)[rank]

        fn = ulysses_attention
    local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    out = fn(*local, scale, dist.group.WORLD)
    out.backward(shard(grad))
    diffs = {"out": float((out - shard(ref.detach())).abs().max())}
    for name, a, b in zip("qkv", local, full, strict=True):
        diffs["d" + name] = float((a.grad - shard(b.grad)).abs().max())
    return diffs


def cp_attention_cases(cases: list[dict]) -> list[dict]:
    """:func:`cp_attention_parity` for each case in one process group (one spawn, many cases)."""
    return [cp_attention_parity(**case) for case in cases]


def hybrid_groups(ulysses_degree: int):
    """(ulysses group, ring group) of this rank; every rank must call this, in the same order.

    Ulysses groups are runs of consecutive ranks; a ring group holds the ranks at the same
    position of every Ulysses group.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ulysses_degree:
        raise ValueError(
            f"context-parallel size {world} is not divisible by --ulysses-degree-in-cp "
            f"{ulysses_degree}"
        )
    mine_u = mine_r = None
    for start in range(0, world, ulysses_degree):
        g = dist.new_group(list(range(start, start + ulysses_degree)))
        if start <= rank < start + ulysses_degree:
            mine_u = g
    for pos in range(ulysses_degree):
        g = dist.new_group(list(range(pos, world, ulysses_degree)))
        if rank % ulysses_degree == pos:
            mine_r = g
    return mine_u, mine_r


def gloo_collectives(async_op: bool) -> dict:
    """The gloo-collectives rewrites vs torch's own reduce-scatter / all-gather, on Megatron's
    layout (this rank's shard is a view of the buffer) and on a layout they must not touch."""
    import torch
    import torch.distributed as dist

    from anyspeed.features.comm import gloo_collectives as gc

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    fell_back = []

    def orig_rs(output, input, **kw):
        fell_back.append("rs")
        return dist.reduce_scatter_tensor(output, input, **kw)

    def orig_ag(output, input, **kw):
        fell_back.append("ag")
        return dist.all_gather_into_tensor(output, input, **kw)

    def done(work):
        if async_op:
            work.wait()

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        n = 24 * world
        # Integer values: every order of summation gives the same bits.
        grads = torch.randint(-50, 50, (n,), generator=g).to(dtype)
        ref = torch.empty(n // world, dtype=dtype)
        dist.reduce_scatter_tensor(ref, grads.clone())
        shard = grads.view(world, -1)[rank]
        done(gc.reduce_scatter(shard, grads, async_op=async_op, _orig=orig_rs))
        out[f"reduce_scatter {dtype}"] = torch.equal(shard, ref)

        params = torch.randint(-50, 50, (n,), generator=g).to(dtype)  # stale elsewhere
        mine = params.view(world, -1)[rank]
        ref = torch.empty(n, dtype=dtype)
        dist.all_gather_into_tensor(ref, mine.clone())
        done(gc.all_gather(params, mine, async_op=async_op, _orig=orig_ag))
        out[f"all_gather {dtype}"] = torch.equal(params, ref)
    # Not this rank's slice of the buffer: torch's own collective runs.
    buf = torch.ones(4 * world)
    done(gc.reduce_scatter(torch.empty(4), buf, async_op=async_op, _orig=orig_rs))
    done(gc.all_gather(torch.empty(4 * world), torch.ones(4), async_op=async_op, _orig=orig_ag))
    out["fell_back"] = fell_back
    dist.destroy_process_group()
    return out


def gather_split_1d() -> list:
    """Megatron's ``gather_split_1d_tensor`` (flat output, shaped input) at TP2 under gloo."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.utils import gather_split_1d_tensor

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    got = gather_split_1d_tensor(torch.arange(8.0).view(2, 4) + 100 * rank)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return got.tolist()


def groups_after_destroy() -> dict:
    """Parallel state set up and torn down three times (TP2): the groups Megatron held are
    gone from torch's registry after each teardown, and a later set-up still works."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from anyspeed.testing import megatron_groups as testing_megatron_groups
    from anyspeed.testing.megatron_groups import _groups

    plain = ps.destroy_model_parallel
    testing_megatron_groups.install()
    try:
        dist.init_process_group("gloo")
        left, sums = [], []
        for _ in range(3):
            ps.initialize_model_parallel(tensor_model_parallel_size=2)
            x = torch.ones(1)
            dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
            sums.append(x.item())
            held = [g for n, v in vars(ps).items() if n.startswith("_") for g in _groups(v)]
            ps.destroy_model_parallel()
            registry = dist.distributed_c10d._world.pg_map
            left.append(sum(g in registry for g in held if g is not dist.GroupMember.WORLD))
        dist.destroy_process_group()
    finally:  # these ranks may serve later tests: the one line alone again
        ps.destroy_model_parallel = plain
    return {"left": left, "held": len(held), "sums": sums}
