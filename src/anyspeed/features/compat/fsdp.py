"""Level-0 feature ``fsdp-compat``: Megatron-Core's two FSDP paths on every device.

Megatron-FSDP (``--use-megatron-fsdp``) reduces gradients with NCCL's ``PREMUL_SUM`` (the
averaging factor fused into the reduce-scatter), which gloo and other backends lack: there the
gradients are scaled first and summed, as Megatron-FSDP itself does for bf16. Its adapter also
tests modules against Transformer Engine's ``TELinear`` at TP > 1, which is None without TE.

TorchFullyShardedDataParallel (``--use-torch-fsdp2``):

- Megatron-Core 0.16.1's ``finalize_model_grads`` calls ``finish_grad_sync(force_all_reduce=...)``
  on every model chunk, but the FSDP2 wrapper inherits ``_BaseDataParallel.finish_grad_sync()``,
  which takes no argument: every training step failed with a TypeError. FSDP2 reduce-scatters
  the gradients during backward, so there is nothing to finish; the argument is ignored.
- Checkpoints: Megatron matches each optimizer parameter to its model ``ShardedTensor`` by the
  identity of the parameter's local shard (``id(param.to_local())``), but with torch 2.13
  ``DTensor.to_local()`` returns a new tensor object on every call, so no parameter matched and
  saving failed ("Param id 0 does not match any model sharded param"). The match is made here
  by the local shard's storage, offset and shape, which are the same on every call.
- Checkpoints of a SwiGLU ``linear_fc1``: see :func:`swiglu_fsdp2`.
- Resuming in Megatron-LM: its loader skipped the optimizer's ``load_state_dict`` for FSDP2
  (the shards load in place), which left torch's AdamW (used without Apex) with no ``step``:
  a KeyError at the first step. The optimizer's state is loaded, as DTensors.
- Per-token loss (``calculate_per_token_loss``, the SFT stages): Megatron divides the summed
  gradients by the batch's token count through ``scale_gradients``, which the FSDP2 wrapper left
  a no-op, so its gradients were the token sum averaged over the data-parallel ranks (a grad
  norm 31x DDP's on a tiny SFT run). It now scales them by ranks / tokens.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from typing import Any

import torch

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.features.compat.fsdp_checkpoint import fp32_fsdp_dtensor_state
from anyspeed.patching import PatchManager


def accept_force_all_reduce(previous: Any) -> Any:
    """``finish_grad_sync`` that takes (and ignores) Megatron's ``force_all_reduce``."""

    @functools.wraps(previous)
    def finish_grad_sync(self: Any, *args: Any, force_all_reduce: bool = False) -> Any:
        return previous(self, *args)

    return finish_grad_sync


def _where(t: Any) -> tuple[int, int, tuple[int, ...]]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)


def match_by_storage(previous: Any) -> Any:
    """``get_param_id_to_sharded_param_map`` that also matches FSDP2 (DTensor) parameters."""

    @functools.wraps(previous)
    def get_param_id_to_sharded_param_map(model_sharded_state_dict: Any, optim_params: Any) -> Any:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        params = list(optim_params)
        if not any(hasattr(p, "to_local") for p in params):
            return previous(model_sharded_state_dict, params)
        index: dict[tuple[int, int, tuple[int, ...]], int] = {}
        for i, p in enumerate(params):
            index.setdefault(_where(p), i)
        tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
        found = {}
        for ten in nested_values(tensors):
            data = getattr(ten, "data", None)
            if isinstance(data, torch.Tensor) and _where(data) in index:
                found[index[_where(data)]] = ten
        return found

    return get_param_id_to_sharded_param_map


# Whether the last data-parallel wrapper built in this process is FSDP2's: only then are model
# shards FSDP2 row blocks (a DDP expert shard at an expert-TP of tp x dp has the same shape).
_LAST_WRAPPER = {"fsdp2": False}


def note_wrapper(previous: Any) -> Any:
    """``_BaseDataParallel.__init__`` that records which wrapper was built last."""

    @functools.wraps(previous)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        previous(self, *args, **kwargs)
        _LAST_WRAPPER["fsdp2"] = type(self).__name__ == "TorchFullyShardedDataParallel"

    return __init__


def _fsdp2_split(sh_ten: Any, axis: int) -> tuple[int, int, int, int] | None:
    """(tp rank, tp size, dp rank, dp size) when ``sh_ten`` is an FSDP2 shard of a TP-local
    tensor (Megatron fragments axis 0 into tp x dp pieces for those); None otherwise."""
    from megatron.core import parallel_state as ps

    if not _LAST_WRAPPER["fsdp2"]:
        return None
    tp = ps.get_tensor_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    frag = sh_ten.axis_fragmentations[axis]
    if dp == 1 or frag != tp * dp:
        return None
    piece = sh_ten.global_offset[axis] // sh_ten.local_shape[0]  # the data's axis 0
    return piece // dp, tp, piece % dp, dp


def swiglu_fsdp2(previous: Any) -> Any:
    """Megatron's SwiGLU checkpoint factory for FSDP2 shards of ``linear_fc1``.

    Megatron's factory takes a shard along axis 0 to be one TP rank's ``[w; v]`` and cuts it in
    two. An FSDP2 shard is a block of rows of that ``[w; v]``: with an even data-parallel size
    each block lies in ``w`` or in ``v``, and is saved as that piece of the global ``w`` or
    ``v`` (the same global tensors DDP saves, so either loads the other's checkpoints)."""

    @functools.wraps(previous)
    def apply_swiglu_sharded_factory(
        original_sh_ten: Any, sharded_offsets: Any, singleton_local_shards: bool = False
    ) -> Any:
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        axis = len(sharded_offsets)
        split = _fsdp2_split(original_sh_ten, axis)
        if split is None:
            return previous(original_sh_ten, sharded_offsets, singleton_local_shards)
        tp_rank, tp, d, dp = split
        if dp % 2:
            raise ValueError(
                "--use-torch-fsdp2 checkpoints of a gated MLP (SwiGLU) need an even "
                f"data-parallel size, not {dp}"
            )
        half = dp // 2
        is_w, j = d < half, d % half
        if singleton_local_shards:
            suffix, offset = f"_{'w' if is_w else 'v'}", (axis, tp_rank * half + j, tp * half)
        else:
            index = tp_rank * half + j + (0 if is_w else tp * half)
            suffix, offset = "", (axis, index, tp * dp)

        def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
            # ``key``: the factory's key when it is built (Megatron renames keys after this)
            return [
                ShardedTensor.from_rank_offsets(
                    key + suffix, t, *sharded_offsets, offset, replica_id=replica_id,
                    prepend_axis_num=axis,
                )
            ]  # fmt: skip

        return ShardedTensorFactory(
            original_sh_ten.key,
            original_sh_ten.data,
            build,
            lambda parts: parts[0],
            original_sh_ten.replica_id,
            flattened_range=original_sh_ten.flattened_range,
        )

    return apply_swiglu_sharded_factory


def scale_then_sum(previous: Any) -> Any:
    """Megatron-FSDP's gradient reduce op: PREMUL_SUM only where the group's backend is NCCL;
    elsewhere the gradients are scaled and summed."""

    @functools.wraps(previous)
    def gradient_reduce_preprocessing(grad_data: Any, scaling_factor: Any, ddp_config: Any) -> Any:
        import copy

        import torch.distributed as dist

        fused = getattr(ddp_config, "gradient_reduce_div_fusion", False)
        if fused and dist.is_initialized() and dist.get_backend() != "nccl":
            ddp_config = copy.copy(ddp_config)  # the run's own config stays as it was
            ddp_config.gradient_reduce_div_fusion = False
        return previous(grad_data, scaling_factor, ddp_config)

    return gradient_reduce_preprocessing


def scale_fsdp2_gradients(self: Any, scaling_factor: float) -> None:
    """FSDP2's reduce-scatter averaged the gradients over the data-parallel ranks, where DDP
    sums them before this scaling: multiply by the ranks too."""
    ranks = self.device_mesh.size()
    for p in self.module.parameters():
        if p.grad is not None:
            p.grad.mul_(scaling_factor * ranks)


def optimizer_state_as_dtensors(previous: Any) -> Any:
    """``FP32Optimizer.load_state_dict`` that takes Megatron's checkpoint of FSDP2 parameters
    (local shards) as the DTensors torch's optimizer steps."""

    @functools.wraps(previous)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        from anyspeed.distributed.dtensors import optimizer_dtensors

        return previous(self, optimizer_dtensors(state_dict, self))

    return load_state_dict


def load_fsdp2_optimizer(previous: Any) -> Any:
    """Megatron-LM's ``load_checkpoint`` with the optimizer's state loaded for FSDP2 too (the
    model's shards load in place; the wrapper's own ``load_state_dict`` is a no-op)."""

    @functools.wraps(previous)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        if getattr(get_args(), "use_torch_fsdp2", False):
            kwargs["skip_load_to_model_and_opt"] = False
        return previous(*args, **kwargs)

    return load_checkpoint


class _NoTELinear:
    """Stands for Transformer Engine's TELinear where TE is not installed: no module is one."""


class FSDPCompat(Feature):
    name = "fsdp-compat"
    level = 0
    description = "Megatron-FSDP and --use-torch-fsdp2 on every device and backend"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if importlib.util.find_spec("transformer_engine") is None:
            pm.register_replace(
                "megatron.core.distributed.fsdp.mcore_fsdp_adapter.TELinear",
                _NoTELinear,
                feature=self.name,
                reason="--use-megatron-fsdp at TP > 1 without Transformer Engine: the adapter's "
                "isinstance(module, (TELinear,)) failed on TELinear = None",
            )
        pm.register_wrap(
            "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer."
            "gradient_reduce_preprocessing",
            scale_then_sum,
            feature=self.name,
            reason="--use-megatron-fsdp off NCCL: the averaging was fused into the reduce with "
            "ReduceOp.PREMUL_SUM, which gloo does not have",
        )
        pm.register_wrap(
            "megatron.core.distributed.data_parallel_base._BaseDataParallel.finish_grad_sync",
            accept_force_all_reduce,
            feature=self.name,
            reason="--use-torch-fsdp2: finalize_model_grads passes force_all_reduce, which the "
            "FSDP2 wrapper's finish_grad_sync() did not accept (TypeError every step)",
        )
        pm.register_replace(
            "megatron.core.distributed.torch_fully_sharded_data_parallel."
            "TorchFullyShardedDataParallel.scale_gradients",
            scale_fsdp2_gradients,
            feature=self.name,
            reason="--use-torch-fsdp2 with a per-token loss (SFT): the wrapper inherited a no-op "
            "scale_gradients, so gradients were never divided by the batch's token count",
            create=True,
        )
        pm.register_wrap(
            "megatron.core.optimizer.optimizer.FP32Optimizer.load_state_dict",
            optimizer_state_as_dtensors,
            feature=self.name,
            reason="--use-torch-fsdp2 resume: the checkpoint holds the parameters' local shards, "
            "torch's optimizer state must be DTensors like its parameters",
        )
        if importlib.util.find_spec("megatron.training") is not None:
            pm.register_wrap(
                "megatron.training.checkpointing.preprocess_fsdp_dtensor_state_dict",
                fp32_fsdp_dtensor_state,
                feature=self.name,
                reason="pretrain_gpt.py --use-megatron-fsdp --ckpt-format fsdp_dtensor in fp32: "
                "the SwiGLU split failed (AttributeError), and ranks holding no rows of a "
                "parameter deadlocked the offset exchange",
            )
            pm.register_wrap(
                "megatron.training.checkpointing.load_checkpoint",
                load_fsdp2_optimizer,
                feature=self.name,
                reason="pretrain_gpt.py --use-torch-fsdp2 resume: Megatron-LM skipped the "
                "optimizer's load_state_dict, and torch's AdamW then had no 'step' (KeyError)",
            )
        pm.register_wrap(
            "megatron.core.optimizer.optimizer.get_param_id_to_sharded_param_map",
            match_by_storage,
            feature=self.name,
            reason="--use-torch-fsdp2 checkpoints: DTensor.to_local() is a new object on every "
            "call, so Megatron's match of optimizer to model parameters by id() found none",
        )
        pm.register_wrap(
            "megatron.core.distributed.data_parallel_base._BaseDataParallel.__init__",
            note_wrapper,
            feature=self.name,
            reason="--use-torch-fsdp2 checkpoints: the SwiGLU factory below applies to FSDP2's "
            "shards only, so the process notes which wrapper it built last",
        )
        pm.register_wrap(
            "megatron.core.transformer.mlp.apply_swiglu_sharded_factory",
            swiglu_fsdp2,
            feature=self.name,
            reason="--use-torch-fsdp2 checkpoints: the SwiGLU factory cut each FSDP2 row shard "
            "of linear_fc1 in two as if it held [w; v], so DDP and FSDP2 read each other's "
            "checkpoints wrong",
        )
