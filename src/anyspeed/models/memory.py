"""Per-rank memory of a training layout, before anything starts: parameters, gradients,
optimizer state and the activations autograd keeps for backward.

The activation terms follow what Megatron-Core's local spec with anyspeed's default kernels
(``--optimization-level`` 1 or 2: SDPA attention, one-node SwiGLU and RoPE, torch norms, the
chunked fused cross-entropy) save for backward, tensor by tensor; the bytes meter
(:mod:`anyspeed.features.memory.meter`) measures the same quantity, and the tests hold the two
together. MoE layers (Megatron's all-gather token dispatcher, sequential experts): the router's
scores and routing maps, the permuted tokens and each expert's MLP on the tokens routed to it,
counted at the expected share (tokens x top-k, split evenly over the EP ranks); the exact count
depends on the routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig
from anyspeed.models.memory_mixers import (
    F32,
    delta_activations,
    delta_params,
    mla_activations,
    mla_params,
    norm_bytes,
)
from anyspeed.models.recompute import Recompute


@dataclass
class Options:
    """What besides the model and the layout decides the memory of a rank."""

    seq_length: int = 2048
    micro_batch_size: int = 1
    num_microbatches: int = 1  # per step on one data-parallel rank
    precision: str = "fp32"  # fp32 | bf16 | fp16
    grad_reduce_in_fp32: bool = False
    optimizer: str = "adam"
    recompute: Recompute = field(default_factory=Recompute)
    recompute_activation: int | None = 0  # layers per chunk (None: all, 0: off)
    recompute_norm: int | None = 0
    # attention with query/key heads unlike the value heads (MLA) on PyTorch's math path (the
    # CPU's), which keeps the probabilities; CUDA's memory-efficient kernel takes them fused
    math_attention: bool = True
    # --fp8-format: the transformer layers' linears keep their inputs in one byte (fp8.md)
    fp8: bool = False

    @property
    def dtype_bytes(self) -> int:
        return F32 if self.precision == "fp32" else 2


@dataclass
class RankMemory:
    """Bytes held by one rank (the largest pipeline stage)."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    activations_per_microbatch: int
    microbatches_in_flight: float
    main_gradients: int = 0  # of ``gradients``: fp32 copies, alive only around the update

    @property
    def activations(self) -> int:
        return int(self.activations_per_microbatch * self.microbatches_in_flight)

    @property
    def total(self) -> int:
        """The peak: the fp32 main gradients (made at the optimizer step, dropped at the next
        step's zero_grad) and the activations (alive from forward to backward) never meet."""
        shared = min(self.main_gradients, self.activations)
        return self.parameters + self.gradients + self.optimizer + self.activations - shared


def _layer_params(m: ModelConfig, lay: Layout, linear: bool = False) -> int:
    """Parameters of one transformer layer on one rank (dense or MoE; ``linear``: a gated
    DeltaNet layer)."""
    h, d, tp = m.hidden_size, m.head_dim, lay.tp
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    if m.multi_latent_attention or linear:
        n = (mla_params(m, tp) if m.multi_latent_attention else delta_params(m, tp)) + 2 * h
    else:
        n = (h * (q + 2 * kv) + q * h) // tp + 2 * h  # QKV, proj; two norms (replicated)
        n += (q + 2 * kv) // tp if m.add_qkv_bias else 0
        n += 2 * d if m.qk_layernorm else 0
        n += q * h // tp if m.attention_output_gate else 0
    mats = 3 if m.gated else 2
    if m.add_bias_linear:
        n += h + (mats - 1) * m.ffn_hidden_size // tp + h
    return n + (2 * h if m.post_norm else 0)  # the sandwich norms


def _expert_params(m: ModelConfig, lay: Layout) -> int:
    """The routed experts of one MoE layer on one rank (split over EP and expert-TP)."""
    mats, experts = (3 if m.gated else 2), (m.num_experts or 0) // lay.ep
    return experts * mats * m.hidden_size * m.expert_ffn_size // lay.expert_tp


def _mlp_params(m: ModelConfig, lay: Layout, moe: bool) -> int:
    mats, h = (3 if m.gated else 2), m.hidden_size
    if not moe:
        return mats * h * m.ffn_hidden_size // lay.tp
    n = _expert_params(m, lay) + h * (m.num_experts or 0)  # + the router
    n += h if m.moe_shared_expert_gate else 0
    return n + mats * h * (m.moe_shared_expert_intermediate_size or 0) // lay.tp


def _stage_layers(m: ModelConfig, lay: Layout, stage: int) -> list[range]:
    """The decoder layers (global indices) of each model chunk of pipeline stage ``stage``."""
    return lay.chunk_layers(m.num_layers, stage)


def stage_parameters(m: ModelConfig, lay: Layout, stage: int) -> tuple[int, int]:
    """(all, routed-expert) parameters held by one rank of pipeline stage ``stage`` (all its
    virtual chunks); expert parameters are reduced and sharded over expert-DP."""
    moe, linear = m.moe_layers(), m.linear_attention_layers()
    n = experts = 0
    for layers in _stage_layers(m, lay, stage):
        for i in layers:
            n += _layer_params(m, lay, linear[i]) + _mlp_params(m, lay, moe[i])
            experts += _expert_params(m, lay) if moe[i] else 0
    emb = m.vocab_size * m.hidden_size // lay.tp
    if stage == 0:
        n += emb
    if stage == lay.output_pp_rank:  # the final norm and the output layer (DualPipeV: rank 0)
        n += m.hidden_size + (0 if m.tie_embeddings and lay.pp == 1 else emb)
    return n, experts


def layer_activations(
    m: ModelConfig,
    lay: Layout,
    o: Options,
    act: bool,
    norm: bool,
    moe: bool = False,
    linear: bool = False,
    blocked: bool = False,
) -> int:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank
    (``linear``: a gated DeltaNet layer; ``blocked``: attention through blocked attention)."""
    e, tp, b, h = o.dtype_bytes, lay.tp, o.micro_batch_size, m.hidden_size
    s = o.seq_length // lay.cp
    tokens = s * b
    normed = tokens // tp if lay.sequence_parallel else tokens  # sequence-parallel regions
    modules = o.recompute.modules if o.recompute.granularity == "selective" else []
    norm = norm or "layernorm" in modules
    # an FP8 linear after the norm keeps its own copy; a MoE layer's router keeps the norm's
    mlp_fp8 = o.fp8 and not moe and "mlp" not in modules
    total = norm_bytes(normed, h, e, norm, o.fp8) + norm_bytes(normed, h, e, norm, mlp_fp8)
    if m.multi_latent_attention:
        total += mla_activations(m, lay, s, b, e, o.math_attention)
    elif linear:
        total += delta_activations(m, lay, s, b, e)
    else:
        total += _attention_activations(m, lay, modules, s, b, e, o.fp8, blocked)
    if m.post_norm:  # the sandwich norms (never recomputed): all but an output a linear keeps
        total += 2 * (norm_bytes(normed, h, e) - normed * h * e)
    if m.layernorm_zero_centered_gamma:  # each norm keeps its 1 + w (fp32) unless recomputed
        total += ((0 if norm else 2) + (2 if m.post_norm else 0)) * h * F32
    if "mlp" in modules:
        return total
    if not moe:
        return total + _mlp(m, tokens, m.ffn_hidden_size // tp, e, act, o.fp8)
    return total + moe_activations(m, lay, o, normed, act)


def _attention_activations(
    m: ModelConfig,
    lay: Layout,
    modules: list[str],
    s: int,
    b: int,
    e: int,
    fp8: bool = False,
    blocked: bool = False,
) -> int:
    """What grouped-query attention keeps (the rotary tables, the rotated and projected
    queries, keys and values, the attention's output and log-sum-exp, the QK norms'). An FP8
    output projection keeps a one-byte copy of its input, besides the fused attention's.
    ``blocked``: sinks, a window or soft-capped scores (anyspeed's blocked attention)."""
    tokens, d = s * b, m.head_dim
    heads, groups = m.num_attention_heads // lay.tp, m.num_query_groups // lay.tp
    total = 4 * s * int(d * m.rotary_percent) * e  # RoPE: cos and sin, for q and for k
    total += tokens * d * (heads + groups) * e  # rotated q and k
    total += tokens * d * (heads + 2 * groups) * e  # the QKV output (v is a view of it)
    out = tokens * d * heads  # attention output (linear_proj's input)
    total += out * e if not fp8 else out * (1 if "core_attn" in modules else 1 + e)
    if m.attention_output_gate:  # its rows of the QKV output, sigmoid(gate), the gated output
        total += 3 * tokens * d * heads * e
    if m.qk_layernorm:  # q copied out of the QKV output; both norms' fp32 x * rstd and rstd
        total += tokens * d * heads * e + tokens * (heads + groups) * (d + 1) * F32
    if "core_attn" not in modules:
        total += b * heads * s * F32  # log-sum-exp of the fused attention
        if blocked:  # blocked attention keeps its output apart from linear_proj's input
            total += out * e
    return total


def _mlp(m: ModelConfig, tokens: int, ffn: int, e: int, act: bool, fp8: bool = False) -> int:
    """A dense MLP's fc1 output (the activation's input) and activation output (fc2's input;
    an FP8 fc2 keeps its own one-byte copy, recomputed or not)."""
    fc2_input = tokens * ffn if fp8 else (0 if act else tokens * ffn * e)
    # the tanh GeGLU is Megatron's unfused GLU: the activated gate and the product (measured)
    glu = 2 * tokens * ffn * e if m.gelu_tanh and not act else 0
    return tokens * ffn * (2 if m.gated else 1) * e + fc2_input + glu


def moe_activations(m: ModelConfig, lay: Layout, o: Options, tokens: int, act: bool) -> int:
    """A MoE layer (all-gather dispatcher) on ``tokens`` local tokens: router (int64 top-k
    indices twice, fp32 top-k probabilities and scores), the routing map and probabilities
    of the gathered tokens for the local experts, the permuted tokens with their order and
    probabilities, and per routed token the expert's fc1 output, activation output and its
    probability-scaled copy (activation recompute: fc1 output only); shared experts as a dense
    MLP."""
    e, k, experts = o.dtype_bytes, m.moe_router_topk, m.num_experts or 0
    gathered = tokens * lay.expert_tp * lay.ep  # over the expert-TP x EP group
    routed = gathered * k // lay.ep  # expected tokens for this rank's experts
    total = tokens * k * (2 * 8 + F32) + tokens * experts * F32 + experts * 8 + F32
    total += experts // lay.ep * gathered * (1 + F32)  # routing map (bool) and probabilities
    ffn = m.expert_ffn_size // lay.expert_tp
    fc1 = (2 if m.gated else 1) * e
    if not o.fp8:
        total += routed * (8 + m.hidden_size * e + F32)  # order, permuted tokens, probabilities
        total += routed * ffn * (fc1 + (0 if act else 2 * e))  # act: fc1's output only
    else:  # FP8 experts keep 1-byte copies of their inputs, not the permuted tokens themselves
        total += routed * (8 + m.hidden_size + F32)
        total += routed * ffn * (fc1 + (0 if act else e) + 1)
    shared = (m.moe_shared_expert_intermediate_size or 0) // lay.tp
    if not shared:
        return total
    return total + _mlp(m, tokens, shared, e, act, o.fp8) + (tokens * m.hidden_size if o.fp8 else 0)


def _full_recompute_units(o: Options, layers: int) -> int:
    """Layers of a chunk that full recompute replaces by one saved input per unit."""
    r = o.recompute
    if r.granularity != "full":
        return 0
    return layers if r.method == "uniform" else min(r.num_layers or 0, layers)


def _selected(flag: int | None, i: int) -> bool:
    return flag is None or i < flag


def chunk_activations(
    m: ModelConfig, lay: Layout, o: Options, first: bool, last: bool, layers: range | None = None
) -> int:
    """Bytes one model chunk (decoder ``layers``, default the first) keeps for backward for
    one micro-batch on one rank."""
    e, b = o.dtype_bytes, o.micro_batch_size
    s, h = o.seq_length // lay.cp, m.hidden_size
    tokens = s * b
    normed = tokens // lay.tp if lay.sequence_parallel else tokens
    layers = layers or _stage_layers(m, lay, 0)[0]
    moe, linear = m.moe_layers(), m.linear_attention_layers()
    special = bool(m.attn_logit_softcapping) or m.softmax_type not in (None, "vanilla")
    blocked = [special or w for w in m.window_layers()]
    full = _full_recompute_units(o, len(layers))
    total = 0
    for i in range(full, len(layers)):
        act, norm = _selected(o.recompute_activation, i), _selected(o.recompute_norm, i)
        total += layer_activations(
            m,
            lay,
            o,
            act and o.recompute_activation != 0,
            norm and o.recompute_norm != 0,
            moe[layers[i]],
            linear[layers[i]],
            blocked[layers[i]],
        )
    if full:
        per_unit = o.recompute.num_layers if o.recompute.method == "uniform" else 1
        hidden = normed * h * e
        if o.recompute.distribute_saved_activations and not lay.sequence_parallel:
            hidden //= lay.tp
        total += math.ceil(full / per_unit) * hidden + s * m.head_dim * F32  # + RoPE angles
    if first:
        total += tokens * 8 + (tokens if lay.tp > 1 else 0)  # token ids (+ vocab-range mask)
    if last:
        total += norm_bytes(normed, h, e)  # final norm; its output is the output layer's
        total += tokens * m.vocab_size // lay.tp * e  # logits
        if m.output_logit_softcapping:  # the cap's tanh
            total += tokens * m.vocab_size // lay.tp * e
        if m.layernorm_zero_centered_gamma:
            total += h * F32
        total += tokens * (8 + 1 + F32)  # cross-entropy: targets, mask, per-token values
    return total


def in_flight(lay: Layout, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations a rank of ``stage`` holds at once (1F1B warm-up; in
    chunks' worth of a whole stage for the interleaved schedule)."""
    if lay.pp == 1:
        return 1.0
    if lay.chunks == 1:
        return float(min(lay.pp - stage, microbatches))
    if lay.dualpipev:  # the most chunk activations the rank's plan holds at once
        from anyspeed.distributed.dualpipev import plan

        m = max(microbatches, 2 * lay.pp)  # fewer are refused before a run starts
        plans = [plan.training_plan(lay.pp, r, m) for r in range(lay.pp)]
        return plan.simulate(plans).peak_alive[stage] / lay.chunks
    warmup = (lay.pp - stage - 1) * 2 + (lay.chunks - 1) * lay.pp + 1
    return min(warmup, microbatches * lay.chunks) / lay.chunks


def zero_stage(lay: Layout) -> int:
    """What the data-parallel ranks shard, as ZeRO stages: 0 (DDP), 1 (the distributed
    optimizer, Megatron-FSDP's ``optim``), 2 (+ gradients, ``optim_grads``), 3 (+ parameters:
    ``optim_grads_params``, ``--use-torch-fsdp2``)."""
    if lay.torch_fsdp2:
        return 3
    if lay.megatron_fsdp:
        return {"optim": 1, "optim_grads": 2}.get(lay.fsdp_sharding, 3)
    return 1 if lay.distributed_optimizer else 0


def _state_bytes(
    o: Options, params: int, dp: int, zero: int, masters: bool = False
) -> tuple[int, int, int]:
    """(gradient, optimizer, main gradient) bytes for ``params`` parameters on one rank at
    ZeRO stage ``zero`` (:func:`zero_stage`). Gradients: the DDP buffer, plus the fp32 copies
    the optimizer steps on when that buffer is in 16 bits (held from the optimizer step to the
    next step's zero_grad; sharded like the optimizer). ``masters``: fp32 master weights even
    in fp32 training (Megatron-FSDP keeps its own, sharded)."""
    fp32_grads = o.grad_reduce_in_fp32 or o.precision == "fp32"
    masters = masters or o.precision != "fp32"
    per_param = (8 if o.optimizer == "adam" else 4) + (F32 if masters else 0)
    main_grads = 0 if fp32_grads else params * F32
    opt = params * per_param

    def shard(n: int, stage: int = 1) -> int:
        return math.ceil(n / dp) if zero >= stage else n

    grads = shard(params * (F32 if fp32_grads else 2), 2)
    return grads + shard(main_grads), shard(opt), shard(main_grads)


def estimate_stage(
    m: ModelConfig, lay: Layout, world_size: int, o: Options, stage: int
) -> RankMemory:
    """The memory of a rank of pipeline stage ``stage``."""
    params, experts = stage_parameters(m, lay, stage)
    zero, expert_dp = zero_stage(lay), world_size // (lay.ep * lay.expert_tp * lay.pp)
    dense = _state_bytes(o, params - experts, lay.dp(world_size), zero, lay.megatron_fsdp)
    expert = _state_bytes(o, experts, expert_dp, zero, lay.megatron_fsdp)
    grads, opt, main = (a + b for a, b in zip(dense, expert, strict=True))
    acts = 0
    for chunk, layers in enumerate(_stage_layers(m, lay, stage)):
        first = stage == 0 and chunk == 0
        last = lay.stage_of(stage, chunk) == lay.pp * lay.chunks - 1
        acts += chunk_activations(m, lay, o, first, last, layers)
    flight = in_flight(lay, stage, o.num_microbatches)
    held = params if zero < 3 else math.ceil(params / lay.dp(world_size))  # FSDP's own shard
    return RankMemory(stage, held * o.dtype_bytes, grads, opt, acts, flight, main)


def critic_bytes(m: ModelConfig, lay: Layout, world_size: int, o: Options, stage: int) -> int:
    """What PPO's critic holds on a rank of ``stage`` for the whole run: a second model of the
    architecture (a hidden -> 1 value head in place of the output layer) with its gradients and
    optimizer state. Its activations never meet the policy's: their steps take turns."""
    params, experts = stage_parameters(m, lay, stage)
    if stage == lay.output_pp_rank:  # the value head in place of the output layer
        emb = m.vocab_size * m.hidden_size // lay.tp
        params += m.hidden_size - (0 if m.tie_embeddings and lay.pp == 1 else emb)
    zero, expert_dp = zero_stage(lay), world_size // (lay.ep * lay.expert_tp * lay.pp)
    dense = _state_bytes(o, params - experts, lay.dp(world_size), zero)
    expert = _state_bytes(o, experts, expert_dp, zero)
    grads, opt, _ = (a + b for a, b in zip(dense, expert, strict=True))
    held = params if zero < 3 else math.ceil(params / lay.dp(world_size))
    return held * o.dtype_bytes + grads + opt


def estimate(m: ModelConfig, lay: Layout, world_size: int, o: Options) -> RankMemory:
    """The memory of the rank that needs the most (over pipeline stages)."""
    stages = [estimate_stage(m, lay, world_size, o, s) for s in range(lay.pp)]
    return max(stages, key=lambda r: r.total)


def frozen_bytes(m: ModelConfig, lay: Layout, stage: int, dtype_bytes: int) -> int:
    """What a frozen model of architecture ``m`` at the training layout (a distillation
    teacher) holds on a rank of ``stage``: its parameters only. No gradients, no optimizer
    state; the activations of its forward-only pass are freed layer by layer."""
    return stage_parameters(m, lay, stage)[0] * dtype_bytes
