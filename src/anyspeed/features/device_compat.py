"""Level-0 features: make Megatron-Core / Megatron-LM run on the detected device.

* ``device-compat``: the device layer's central redirections (torch.cuda surface, CUDA device
  arguments, nccl -> device backend). Registers nothing on CUDA.
* ``megatron-core-compat``: small, named adjustments inside megatron.core for non-CUDA devices.
* ``cuda-only-options``: Megatron options that need CUDA-only libraries are refused off CUDA with
  a one-line error naming the flag, before any process group starts.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging

from anyspeed.device import DeviceInfo, redirect
from anyspeed.features import Feature, FeatureError, flag_set, flag_value, register_feature
from anyspeed.patching import PatchManager


class DeviceCompat(Feature):
    name = "device-compat"
    level = 0
    description = (
        "torch.cuda surface, literal CUDA device arguments and nccl process groups routed to "
        "this device (a no-op on CUDA)"
    )

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        return True, "no-op on CUDA" if device.is_cuda else ""

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if device.is_cuda:
            return
        redirect.register_cuda_surface(pm, device, self.name)
        redirect.register_device_args(pm, device, self.name)
        redirect.register_dist_backend(pm, device, self.name)


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


_RNG_NOTE = "CPU RNG state changed within GPU RNG context"


class MegatronCoreCompat(Feature):
    name = "megatron-core-compat"
    level = 0
    description = "adjustments inside megatron.core for non-CUDA devices"

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        return not device.is_cuda

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        from anyspeed.features.ops.norm import DeviceNorm

        pm.register_replace(
            "megatron.core.transformer.torch_norm.WrappedTorchNorm",
            DeviceNorm,
            feature=self.name,
            reason="without TE/apex the local spec's torch norm refuses --sequence-parallel; "
            "DeviceNorm marks its weights for the TP grad all-reduce",
        )
        if device.dist_backend == "gloo":
            from anyspeed.features.pipeline_p2p import tagged_batched_p2p_ops

            pm.register_wrap(
                "megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops",
                tagged_batched_p2p_ops,
                feature=self.name,
                reason="gloo matches p2p messages by posting order: tag each pipeline direction "
                "so PP=2 interleaved activations and gradients cannot swap",
            )
        pm.register_wrap(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
            _with_initialized_torch_adam_state,
            feature=self.name,
            reason="with torch's Adam (no apex/TE) the distributed optimizer's state_dict needs "
            "a 'step' per parameter, missing before the first step: checkpoint loading and "
            "saving at iteration 0 would fail",
        )
        pm.register_wrap(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
            "_set_main_param_and_optimizer_states",
            _keep_torch_adam_step,
            feature=self.name,
            reason="with torch's Adam, a loaded distributed optimizer shares one step tensor "
            "across parameters (advanced once per parameter); give each its own",
        )
        if device.is_cpu:
            # On the CPU the device RNG *is* the CPU generator, so every tracker fork changes it
            # by design; Megatron's warning about that would fire on each dropout call.
            def quiet_fork(fork):
                @functools.wraps(fork)
                def fork_quiet(self, *args, **kwargs):
                    logger = logging.getLogger("megatron.core.tensor_parallel.random")
                    if not any(isinstance(f, _DropMessage) for f in logger.filters):
                        logger.addFilter(_DropMessage(_RNG_NOTE))
                    return fork(self, *args, **kwargs)

                return fork_quiet

            pm.register_wrap(
                "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork",
                quiet_fork,
                feature=self.name,
                reason="the device RNG is the CPU generator: silence the 'CPU RNG state changed' "
                "warning that would fire on every fork",
            )


def _with_initialized_torch_adam_state(state_dict):
    """Give every parameter torch Adam's fresh state (step 0, zero moments) before reading it.

    Exactly what torch's Adam creates at its first step, so training is unchanged.
    """

    @functools.wraps(state_dict)
    def wrapper(self, *args, **kwargs):
        import torch

        inner = getattr(self, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):
            for group in inner.param_groups:
                for p in group["params"]:
                    st = inner.state[p]
                    if "step" not in st:
                        st["step"] = torch.tensor(0.0)
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state_dict(self, *args, **kwargs)

    return wrapper


def _keep_torch_adam_step(set_states):
    """Give each parameter its own copy of the loaded step, and keep it when setting state.

    Megatron's load gives every parameter the *same* step tensor; torch's Adam increments each
    parameter's step in place, so a shared tensor would advance once per parameter per step
    (wrong bias correction after resume). The reshardable checkpoint keeps the step in the
    param groups, not per parameter, so it is absent from ``tensors``.
    """

    @functools.wraps(set_states)
    def wrapper(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                state["step"] = state["step"].clone()
                tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    return wrapper


class CudaOnlyOptions(Feature):
    name = "cuda-only-options"
    level = 0
    description = "refuses Megatron options that need CUDA-only libraries when not on CUDA"
    flags = ("--transformer-impl", "--fp8-format", "--enable-cuda-graph", "--tp-comm-overlap")

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        return not device.is_cuda

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        if device.is_cuda:
            return
        on = f"this device is {device.type}"
        impl = flag_value(args, "--transformer-impl")
        if impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
            raise FeatureError(
                f"--transformer-impl transformer_engine needs NVIDIA Transformer Engine; {on}: "
                "use --transformer-impl local"
            )
        if flag_value(args, "--fp8-format"):
            raise FeatureError(f"--fp8-format needs CUDA with Transformer Engine; {on}: remove it")
        graph_impl = flag_value(args, "--cuda-graph-impl")
        if flag_set(args, "--enable-cuda-graph") or graph_impl not in (None, "none"):
            raise FeatureError(f"--enable-cuda-graph/--cuda-graph-impl need CUDA; {on}: remove it")
        if flag_set(args, "--tp-comm-overlap"):
            raise FeatureError(
                f"--tp-comm-overlap needs CUDA with Transformer Engine userbuffers; {on}: remove it"
            )


DEVICE_COMPAT = register_feature(DeviceCompat())
MEGATRON_CORE_COMPAT = register_feature(MegatronCoreCompat())
CUDA_ONLY_OPTIONS = register_feature(CudaOnlyOptions())
