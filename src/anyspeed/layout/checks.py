"""The checks of a :class:`~anyspeed.layout.Layout`: against the world size and the model's sizes
and kinds, each problem one ValueError line naming the flag and what would fix it, before any
process group exists (a bad layout otherwise surfaces as a hang or a deep assertion)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the layout imports these checks, not back
    from anyspeed.layout import Layout


def validate(
    layout: Layout,
    world_size: int,
    *,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    seq_length: int | None = None,
    num_experts: int | None = None,
) -> None:
    """Raise ValueError (one line, naming the flag) when the layout cannot work."""
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    if tp < 1 or pp < 1 or cp < 1:
        raise ValueError(
            "--tensor-model-parallel-size, --pipeline-model-parallel-size and "
            "--context-parallel-size must be >= 1"
        )
    if world_size % layout.model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = "
            f"{layout.model_parallel_size}: change the sizes or the number of processes"
        )
    if layout.dualpipev:
        _dualpipev(layout)
    _cp(layout, tp, num_attention_heads, seq_length)
    if num_attention_heads is not None and num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if num_query_groups and num_query_groups % tp and tp % num_query_groups:
        raise ValueError(
            f"--num-query-groups {num_query_groups} and --tensor-model-parallel-size {tp} "
            "must divide one another"
        )
    if num_layers is not None:
        layout.stage_layers(num_layers)  # ValueError naming the flags when they cannot split
    if layout.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if layout.vpp and pp < 2:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size >= 2")
    if layout.overlap_param_gather and not layout.distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
    if layout.torch_fsdp2:
        _torch_fsdp2(layout)
    if layout.megatron_fsdp:
        _megatron_fsdp(layout, layout.dp(world_size))
    _experts(layout, world_size, num_experts)


def _megatron_fsdp(layout: Layout, dp: int) -> None:
    """Megatron-FSDP's limits here (each measured)."""
    if layout.torch_fsdp2:
        raise ValueError("--use-megatron-fsdp and --use-torch-fsdp2 exclude each other")
    if dp == 1:
        raise ValueError(
            "--use-megatron-fsdp at one data-parallel rank: it has nothing to shard, and "
            "Megatron-FSDP 0.16.1 steps wrong there (grad norm 9x DDP's, measured); use two or "
            "more data-parallel ranks, or leave out --use-megatron-fsdp"
        )
    if layout.fsdp_sharding == "no_shard":
        raise ValueError(
            "--data-parallel-sharding-strategy no_shard fails inside Megatron-FSDP 0.16.1 (its "
            "parameter all-gather finds no weight buffer): use optim, optim_grads or "
            "optim_grads_params, or leave out --use-megatron-fsdp for plain DDP"
        )
    for bad, why in (
        (layout.pp > 1, "pipeline parallelism (--pipeline-model-parallel-size 1)"),
        (layout.ep > 1, "expert parallelism (--expert-model-parallel-size 1)"),
    ):
        if bad:
            raise ValueError(f"--use-megatron-fsdp is not checked with {why} here")


def _dualpipev(layout: Layout) -> None:
    """What ``--schedules-method dualpipev`` runs with here (MindSpeed refuses the same)."""
    for bad, why in (
        (layout.pp < 2, "--pipeline-model-parallel-size 2 or more"),
        (layout.overlap_grad_reduce, "no --overlap-grad-reduce (its gradients sync at the end)"),
        (layout.overlap_param_gather, "no --overlap-param-gather (its parameters gather at once)"),
        (layout.torch_fsdp2 or layout.megatron_fsdp, "DDP, not FSDP"),
    ):
        if bad:
            raise ValueError(f"--schedules-method dualpipev needs {why}")


def _torch_fsdp2(layout: Layout) -> None:
    """What Megatron-Core's TorchFullyShardedDataParallel does not combine with (Megatron-LM
    asserts the same)."""
    for bad, why in (
        (layout.pp > 1, "pipeline parallelism (--pipeline-model-parallel-size 1)"),
        (layout.ep > 1, "expert parallelism (--expert-model-parallel-size 1)"),
        (layout.distributed_optimizer, "--use-distributed-optimizer (FSDP2 shards the state)"),
        (layout.overlap_param_gather, "--overlap-param-gather"),
        (layout.overlap_grad_reduce, "--overlap-grad-reduce (FSDP2 overlaps on its own)"),
    ):
        if bad:
            raise ValueError(f"--use-torch-fsdp2 does not combine with {why}")


def _experts(layout: Layout, world_size: int, num_experts: int | None) -> None:
    ep, etp = layout.ep, layout.expert_tp
    if ep < 1 or etp < 1:
        raise ValueError(
            "--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1"
        )
    if ep == 1 and layout.etp in (None, layout.tp):
        return
    if not num_experts:
        raise ValueError(
            "--expert-model-parallel-size/--expert-tensor-parallel-size need a MoE model: "
            "add --num-experts"
        )
    if num_experts % ep:
        raise ValueError(
            f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}"
        )
    ranks = world_size // layout.pp
    if ranks % (ep * etp):
        raise ValueError(
            f"the {ranks} ranks of a pipeline stage are not divisible by "
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp}: "
            "change the sizes or the number of processes"
        )


def validate_for(
    layout: Layout, world_size: int, model: Any, seq_length: int | None = None
) -> None:
    """:func:`validate` with the sizes read from ``model`` (a ``ModelConfig``, or a checked
    namespace where ``num_query_groups`` is None without GQA)."""
    validate(
        layout,
        world_size,
        num_layers=getattr(model, "num_layers", None),
        num_attention_heads=getattr(model, "num_attention_heads", None),
        num_query_groups=getattr(model, "num_query_groups", None),
        seq_length=seq_length,
        num_experts=getattr(model, "num_experts", None),
    )
    tied = getattr(model, "tie_embeddings", None)
    if tied is None:  # a namespace has the flag instead
        tied = not getattr(model, "untie_embeddings_and_output_weights", True)
    if layout.torch_fsdp2 and tied:
        raise ValueError(
            "--use-torch-fsdp2 needs --untie-embeddings-and-output-weights (Megatron's FSDP2 "
            "wrapper shards the embedding and the output layer apart)"
        )
    if getattr(model, "multi_latent_attention", False) and layout.cp > 1:
        raise ValueError(
            "--multi-latent-attention does not run with --context-parallel-size "
            f"{layout.cp} (anyspeed's MLA core has no context-parallel form): use CP 1"
        )
    biases = getattr(model, "add_bias_linear", None)  # a namespace has the flag instead
    if biases is None:
        biases = not getattr(model, "disable_bias_linear", True)
    if getattr(model, "num_experts", None) and biases and layout.expert_tp > 1:
        raise ValueError(
            f"MoE experts with biases (GPT-OSS) need --expert-tensor-parallel-size 1 "
            f"(Megatron-Core 0.16.1 cannot split them; it would be {layout.expert_tp} here)"
        )
    if layout.cp > 1 and getattr(model, "attn_logit_softcapping", None):
        raise ValueError(
            f"--attn-logit-softcapping (Gemma 2) does not run with --context-parallel-size "
            f"{layout.cp} (the context-parallel attention core has no soft-capping): use CP 1"
        )
    sinks = getattr(model, "softmax_type", "vanilla") not in (None, "vanilla")
    if layout.cp > 1 and (sinks or getattr(model, "window_size", None) is not None):
        what = (
            "--softmax-type learnable/off-by-one (GPT-OSS's sinks)"
            if sinks
            else "--window-size (sliding-window attention)"
        )
        raise ValueError(
            f"{what} does not run with --context-parallel-size {layout.cp} "
            "(the context-parallel attention core has no sinks or windows): use CP 1"
        )
    if (
        layout.tp > 1
        and not layout.sequence_parallel
        and getattr(model, "multi_latent_attention", False)
    ):
        raise ValueError(
            f"--multi-latent-attention at --tensor-model-parallel-size {layout.tp} needs "
            "--sequence-parallel (without it Megatron-Core 0.16.1 leaves the gradient of the "
            "shared rotary key partial on each TP rank)"
        )
    delta = getattr(model, "experimental_attention_variant", None)
    heads = [getattr(model, f"linear_num_{k}_heads", 1) or 1 for k in ("key", "value")]
    if delta and any(n % layout.tp for n in heads):
        raise ValueError(
            f"--linear-num-key-heads {heads[0]} and --linear-num-value-heads {heads[1]} "
            f"(gated DeltaNet) must be divisible by --tensor-model-parallel-size {layout.tp}"
        )
    if layout.cp > 1 and delta:
        raise ValueError(
            f"--experimental-attention-variant gated_delta_net (Qwen3-Next) does not run "
            f"with --context-parallel-size {layout.cp} (Megatron-Core 0.16.1's DeltaNet has "
            "no context-parallel form): use CP 1"
        )
    if layout.cp > 1 and getattr(model, "mtp_num_layers", None):
        raise ValueError(
            f"--mtp-num-layers does not run with --context-parallel-size {layout.cp} "
            "(Megatron-Core 0.16.1 averages the MTP loss per CP rank, not over the "
            "sequence): use CP 1"
        )


def _cp(layout: Layout, tp: int, heads: int | None, seq_length: int | None) -> None:
    cp = layout.cp
    if cp == 1:
        return
    if seq_length is not None and seq_length % (2 * cp):
        # Megatron's load-balanced split: two chunks per CP rank.
        raise ValueError(
            f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size "
            f"{cp} = {2 * cp}"
        )
    algo = getattr(layout.cp_algo, "value", layout.cp_algo)  # CPAlgo: Megatron's cp_comm_type
    if algo == "a2a+p2p":  # hybrid
        u = layout.ulysses_degree
        if not u or u < 1 or cp % u:
            raise ValueError(
                f"--context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp "
                f"dividing --context-parallel-size {cp} (got {u})"
            )
    degree = {"a2a": cp, "a2a+p2p": layout.ulysses_degree or 1}.get(algo, 1)
    if degree > 1 and heads is not None and heads % (tp * degree):
        raise ValueError(
            f"--num-attention-heads {heads} is not divisible by the Ulysses degree {degree} "
            f"x --tensor-model-parallel-size {tp}"
        )
