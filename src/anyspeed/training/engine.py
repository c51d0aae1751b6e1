"""A small GPT training engine on megatron.core's own classes.

Builds Megatron's GPTModel (local spec) at any TP/PP/VPP/DP layout, wraps it in Megatron's DDP,
makes Megatron's (optionally distributed) optimizer and drives Megatron's pipeline schedules.
It backs the smoke run, the parity tests and the benchmark; the pretraining command grows out
of it. Data is deterministic synthetic tokens, so every layout sees the same global batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from anyspeed.layout import check_layout
from anyspeed.models.factory import PORTABLE_CONFIG


@dataclass
class Layout:
    """Parallel layout. The data-parallel size is what the world leaves over."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_algo: str = "p2p"  # Megatron's cp_comm_type: p2p = ring, a2a = Ulysses, a2a+p2p = hybrid
    ulysses_degree: int | None = None  # hybrid: ranks per Ulysses group
    vpp: int | None = None  # model chunks per pipeline stage (interleaved schedule)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # Gradient bucket size in elements (Megatron-LM's --ddp-bucket-size); None: Megatron's
    # default (one bucket without overlap, at least 40M elements with it).
    bucket_size: int | None = None

    def validate(self, world_size: int, spec: GPTSpec) -> None:
        """One-line ValueError naming the flag when the layout cannot work."""
        check_layout(
            world_size=world_size,
            tp=self.tp,
            pp=self.pp,
            vpp=self.vpp,
            num_layers=spec.num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
            sequence_parallel=self.sequence_parallel,
            cp=self.cp,
            cp_algo=self.cp_algo,
            seq_length=spec.seq_length,
            ulysses_degree=self.ulysses_degree,
        )
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")


@dataclass
class GPTSpec:
    """Architecture of the GPT (LLaMA-style by default: RMSNorm, SwiGLU, RoPE, no biases)."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = 128
    vocab_size: int = 256
    seq_length: int = 32
    swiglu: bool = True
    normalization: str = "RMSNorm"
    position_embedding_type: str = "rope"
    untie_embeddings: bool = True
    init_method_std: float = 0.02
    add_qkv_bias: bool = False
    rotary_base: int = 10000
    # Fields below default to the behaviour the parity tests were written against.
    kv_channels: int | None = None
    qk_layernorm: bool = False
    norm_epsilon: float = 1e-5
    add_bias_linear: bool = False
    max_position_embeddings: int | None = None  # None: seq_length
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0


@dataclass
class TrainConfig:
    micro_batch_size: int = 2
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    data_seed: int = 4321
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None  # fp16: None = dynamic loss scaling
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    optimizer: str = "adam"
    # Reduce gradients in fp32 (Megatron-LM's --accumulate-allreduce-grads-in-fp32). Default:
    # Megatron-LM's, i.e. in the parameters' dtype, so bf16 training reduces bf16 gradients.
    grad_reduce_in_fp32: bool = False


# ------------------------------------------------------------------------------------------------
def init_distributed(layout: Layout, seed: int) -> None:
    """Start the process group (device backend) and Megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from anyspeed.device import detect

    info = detect()
    if not info.is_cpu:  # one accelerator per local rank, as torchrun lays them out
        getattr(torch, info.type).set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=info.dist_backend)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp and layout.vpp > 1 else None,
        hierarchical_context_parallel_sizes=(
            [layout.ulysses_degree, layout.cp // layout.ulysses_degree]
            if layout.cp > 1 and layout.cp_algo == "a2a+p2p" and layout.ulysses_degree
            else None
        ),
    )
    # Megatron-LM's seeding: every generator, offset per pipeline stage; the device generators
    # (and the tensor-parallel tracker) through Megatron. With CPU initialisation this makes the
    # initial weights reproducible and independent of the tensor-parallel size.
    import random

    import numpy as np

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def _dtype(bf16: bool, fp16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def transformer_config(spec: GPTSpec, layout: Layout, bf16: bool = False, fp16: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    vpp = layout.vpp if layout.vpp and layout.vpp > 1 else None
    dtype = _dtype(bf16, fp16)
    portable = dict(PORTABLE_CONFIG)
    portable.update(hidden_dropout=spec.hidden_dropout, attention_dropout=spec.attention_dropout)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        cp_comm_type=layout.cp_algo,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=layout.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=bf16,
        fp16=fp16,
        normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        kv_channels=spec.kv_channels,
        qk_layernorm=spec.qk_layernorm,
        init_method_std=spec.init_method_std,
        deallocate_pipeline_outputs=True,
        **portable,
    )


def build_model(
    spec: GPTSpec,
    layout: Layout,
    bf16: bool = False,
    grad_reduce_in_fp32: bool = False,
    fp16: bool = False,
) -> list[torch.nn.Module]:
    """GPTModel chunks for this rank, wrapped in Megatron's DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from anyspeed.device import torch_device

    config = transformer_config(spec, layout, bf16, fp16)
    layer_spec = get_gpt_layer_local_spec(
        normalization=spec.normalization, qk_layernorm=spec.qk_layernorm
    )
    chunks = layout.vpp if layout.vpp and layout.vpp > 1 else 1
    models = []
    for vp_stage in range(chunks):
        vp = vp_stage if chunks > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings or spec.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=not spec.untie_embeddings,
            position_embedding_type=spec.position_embedding_type,
            rotary_base=spec.rotary_base,
            rotary_percent=spec.rotary_percent,
            rope_scaling=spec.rope_scaling,
            rope_scaling_factor=spec.rope_scaling_factor,
            vp_stage=vp,
        )
        model.to(torch_device())
        if bf16 or fp16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        models.append(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=layout.overlap_grad_reduce,
        overlap_param_gather=layout.overlap_param_gather,
        use_distributed_optimizer=layout.distributed_optimizer,
        bucket_size=layout.bucket_size,
    )
    wrapped = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=m,
            disable_bucketing=(i > 0),
        )
        for i, m in enumerate(models)
    ]
    return wrapped


def build_optimizer(model: list[torch.nn.Module], cfg: TrainConfig, layout: Layout):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        loss_scale=cfg.loss_scale,
        initial_loss_scale=cfg.initial_loss_scale,
        min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis,
        params_dtype=_dtype(cfg.bf16, cfg.fp16),
        use_distributed_optimizer=layout.distributed_optimizer,
        overlap_param_gather=layout.overlap_param_gather,
    )
    return get_megatron_optimizer(opt_config, model)


def synthetic_batch(spec: GPTSpec, cfg: TrainConfig, step: int) -> torch.Tensor:
    """The global batch of step ``step``: [global_batch, seq+1] tokens, identical on every rank.

    Tokens follow a simple learnable rule (each next token is a fixed function of the previous
    one, with noise), so the loss falls visibly in a few dozen steps.
    """
    g = torch.Generator().manual_seed(cfg.data_seed * 1000003 + step)
    n, s, v = cfg.global_batch_size, spec.seq_length + 1, spec.vocab_size
    start = torch.randint(0, v, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(s)) % v
    noise = torch.rand(n, s, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, v, (n, s), generator=g), tokens)


def _microbatches(spec: GPTSpec, cfg: TrainConfig, step: int) -> list[dict[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from anyspeed.device import torch_device

    dp = ps.get_data_parallel_world_size()
    rank = ps.get_data_parallel_rank()
    batch = synthetic_batch(spec, cfg, step)
    per_rank = cfg.global_batch_size // dp
    mine = batch[rank * per_rank : (rank + 1) * per_rank]
    dev = torch_device()
    out = []
    for i in range(0, per_rank, cfg.micro_batch_size):
        mb = mine[i : i + cfg.micro_batch_size]
        batch = {
            "tokens": mb[:, :-1].contiguous().to(dev),
            "labels": mb[:, 1:].contiguous().to(dev),
            "position_ids": torch.arange(spec.seq_length, device=dev).expand(mb.shape[0], -1),
        }
        # Context parallelism: Megatron's load-balanced two-chunk split of the sequence.
        out.append(get_batch_on_this_cp_rank(batch))
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
    )
    loss_mask = batch.get("loss_mask")

    def loss_func(output_tensor):
        from megatron.core import parallel_state as ps

        losses = output_tensor.float()
        if loss_mask is None:
            # Each CP rank holds 1/CP of every sequence and Megatron sums gradients over the
            # CP group: scale the shard mean so the sum is the global mean.
            loss = losses.mean() / ps.get_context_parallel_world_size()
        else:
            mask = loss_mask.float().view(-1)
            count = mask.sum()
            if ps.get_context_parallel_world_size() > 1:
                count = count.clone()
                torch.distributed.all_reduce(count, group=ps.get_context_parallel_group())
            loss = (losses.view(-1) * mask).sum() / count.clamp(min=1.0)
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _set_sync_funcs(model: list[torch.nn.Module], layout: Layout) -> None:
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    if layout.overlap_grad_reduce:
        nos = [m.no_sync for m in model]
        config.no_sync_func = nos[0] if len(nos) == 1 else nos
        gs = [m.start_grad_sync for m in model]
        config.grad_sync_func = gs[0] if len(gs) == 1 else gs
    if layout.overlap_param_gather:
        ps_ = [m.start_param_sync for m in model]
        config.param_sync_func = ps_[0] if len(ps_) == 1 else ps_


class Trainer:
    """Holds model, optimizer and layout; ``step()`` runs one optimizer step."""

    def __init__(self, spec: GPTSpec, layout: Layout, cfg: TrainConfig) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout.validate(world, spec)
        dp = world // (layout.tp * layout.pp * layout.cp)
        if cfg.global_batch_size % (cfg.micro_batch_size * dp):
            raise ValueError(
                f"--global-batch-size {cfg.global_batch_size} is not divisible by "
                f"--micro-batch-size {cfg.micro_batch_size} x data-parallel size {dp}"
            )
        self.spec, self.layout, self.cfg = spec, layout, cfg
        init_distributed(layout, cfg.seed)
        self.model = build_model(spec, layout, cfg.bf16, cfg.grad_reduce_in_fp32, cfg.fp16)
        self.optimizer = build_optimizer(self.model, cfg, layout)
        _set_sync_funcs(self.model, layout)
        self.model[0].config.grad_scale_func = self.optimizer.scale_loss
        self.iteration = 0
        self.dp = dp

    # -------------------------------------------------------------------- checkpoints
    def sharded_state_dict(self) -> dict[str, Any]:
        if len(self.model) == 1:
            return self.model[0].module.sharded_state_dict()
        sd: dict[str, Any] = {}
        for i, m in enumerate(self.model):
            sd[f"model{i}"] = m.module.sharded_state_dict()
        return sd

    def save_model(self, directory: str) -> None:
        """Save the model weights with Megatron's dist_checkpointing (any layout can load)."""
        from megatron.core import dist_checkpointing

        os.makedirs(directory, exist_ok=True)
        dist_checkpointing.save(self.sharded_state_dict(), directory)

    def load_model(self, directory: str) -> None:
        """Load weights saved by :meth:`save_model` at any layout."""
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(self.sharded_state_dict(), directory)
        if len(self.model) == 1:
            self.model[0].module.load_state_dict(state)
        else:
            for i, m in enumerate(self.model):
                m.module.load_state_dict(state[f"model{i}"])
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    # -------------------------------------------------------------------- training
    def _run_schedule(self, mbs: list[dict[str, torch.Tensor]], forward_only: bool) -> float:
        """Run the pipeline schedule over ``mbs``; return the loss averaged over DP replicas."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from anyspeed.device import torch_device

        data = [iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs)
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(mbs),
            seq_length=self.spec.seq_length,
            micro_batch_size=self.cfg.micro_batch_size,
            forward_only=forward_only,
        )
        # Report the loss on every rank: the last stage averages its micro-batch losses.
        last = (
            ps.is_pipeline_last_stage(ignore_virtual=True)
            and ps.get_tensor_model_parallel_rank() == 0
        )
        total = torch.zeros(1, dtype=torch.float64, device=torch_device())
        if last and losses:
            total[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)
        torch.distributed.all_reduce(total)
        return float(total[0]) / self.dp  # CP ranks' shares sum to the replica's mean

    def step(self, microbatches: list[dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        """One optimizer step on this rank's micro-batches (default: the synthetic batch of
        this iteration); the loss is the data-parallel mean."""
        mbs = (
            microbatches
            if microbatches is not None
            else (_microbatches(self.spec, self.cfg, self.iteration))
        )
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self._run_schedule(mbs, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.iteration += 1
        return {
            "loss": loss,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "ok": bool(ok),
        }

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict[str, torch.Tensor]]) -> float:
        """Mean loss of ``microbatches`` without updating anything."""
        for m in self.model:
            m.eval()
        try:
            return self._run_schedule(microbatches, forward_only=True)
        finally:
            for m in self.model:
                m.train()

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits [b, s, vocab] of ``tokens`` through the pipeline schedule.

        Returned on the last pipeline stage (gathered across TP); None on other stages.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        from anyspeed.device import torch_device

        dev = torch_device()
        tokens = tokens.to(dev)
        pos = torch.arange(tokens.shape[1], device=dev).expand(tokens.shape[0], -1)

        def forward_step(data_iterator, model):
            next(data_iterator)
            out = model(tokens, pos, None)

            def collect(output_tensor, non_loss_data=True):
                return gather_from_tensor_model_parallel_region(output_tensor).clone()

            return out, collect

        for m in self.model:
            m.eval()
        n_chunks = len(self.model)
        data = [iter([0]) for _ in range(n_chunks)] if n_chunks > 1 else iter([0])
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.model if n_chunks > 1 else self.model[0],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
        for m in self.model:
            m.train()
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        return out[0].cpu()
