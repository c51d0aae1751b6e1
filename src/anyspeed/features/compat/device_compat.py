"""Level-0 features: make Megatron-Core run on the detected device.

* ``device-compat``: the device layer's central redirections (torch.cuda surface, CUDA device
  arguments, nccl -> device backend). Registers nothing on CUDA.
* ``megatron-core-compat``: small, named adjustments inside megatron.core for non-CUDA devices
  (the algorithms live in :mod:`.pipeline_p2p`, :mod:`.torch_adam`, :mod:`.ckpt_worker` and
  :mod:`.grad_norm`).
"""

from __future__ import annotations

import argparse
import functools
import logging

from anyspeed.device import DeviceInfo, process_groups, redirect
from anyspeed.features.base import Feature
from anyspeed.features.compat import muon_fallback, torch_adam
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
        muon_fallback.install()  # Megatron's Muon needs emerging_optimizers, on every device
        if device.is_cuda:
            return
        redirect.register_cuda_surface(pm, device, self.name)
        redirect.register_device_args(pm, device, self.name)
        process_groups.register_dist_backend(pm, device, self.name)


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
            self._register_gloo(pm)
        self._register_optimizer(pm)
        from anyspeed.features.compat import ckpt_worker

        pm.register_wrap(
            ckpt_worker.TARGET,
            ckpt_worker.spawned_with(install_in_child),
            feature=self.name,
            reason="the asynchronous save's persistent worker is a spawned process without the "
            "one line: its torch.cuda.set_device(rank % device_count()) divides by zero and "
            "the trainer waits forever; the worker installs the device layer first",
        )
        from megatron.core.transformer import multi_latent_attention as mla

        if mla.HAVE_TE and not isinstance(mla.TELinear, type):
            pm.register_replace(
                "megatron.core.transformer.multi_latent_attention.HAVE_TE",
                False,
                feature=self.name,
                reason="without Transformer Engine, MLA's HAVE_TE is True but TELinear is a "
                "stand-in, not a class: isinstance() fails building multi-latent attention",
            )
        if device.is_cpu:
            for cls in (
                "rotary_pos_embedding.RotaryEmbedding",
                "yarn_rotary_pos_embedding.YarnRotaryEmbedding",
            ):
                pm.register_wrap(
                    f"megatron.core.models.common.embeddings.{cls}.__init__",
                    _cpu_initialized,
                    feature=self.name,
                    reason="multi-latent attention builds its rotary embedding without "
                    "use_cpu_initialization, so its frequencies go to torch.cuda.current_device()",
                )

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

    def _register_optimizer(self, pm: PatchManager) -> None:
        """Megatron's optimizer without apex or Transformer Engine: the grad norm, torch's Adam."""
        from anyspeed.features.compat import grad_norm

        pm.register_replace(
            "megatron.core.utils.local_multi_tensor_l2_norm",
            grad_norm.multi_tensor_l2_norm,
            feature=self.name,
            reason="without TE/apex the grad norm Megatron clips with is torch.norm per tensor, "
            "whose fp32 error on the CPU grows with the tensor's size (1e-4 at 4M elements), "
            "so it changed with TP sharding; norms of 4K-element rows summed in fp64",
        )
        pm.register_wrap(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
            torch_adam.with_initialized_torch_adam_state,
            feature=self.name,
            reason="with torch's Adam (no apex/TE) the distributed optimizer's state_dict needs "
            "a 'step' per parameter, missing before the first step: checkpoint loading and "
            "saving at iteration 0 would fail",
        )
        pm.register_wrap(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
            "_set_main_param_and_optimizer_states",
            torch_adam.keep_torch_adam_step,
            feature=self.name,
            reason="with torch's Adam, a loaded distributed optimizer shares one step tensor "
            "across parameters (advanced once per parameter); give each its own",
        )

    def _register_gloo(self, pm: PatchManager) -> None:
        """Where gloo differs from NCCL in what Megatron relies on."""
        from anyspeed.features.compat.pipeline_p2p import tagged_batched_p2p_ops

        pm.register_wrap(
            "megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops",
            tagged_batched_p2p_ops,
            feature=self.name,
            reason="gloo matches p2p messages by posting order: tag each pipeline direction "
            "so PP=2 interleaved activations and gradients cannot swap",
        )
        from anyspeed.features.compat.gloo_shapes import flat_output_all_gather

        pm.register_wrap(
            "megatron.core.tensor_parallel.utils.dist_all_gather_func",
            flat_output_all_gather,
            feature=self.name,
            reason="gloo's all-gather refuses the flat output gather_split_1d_tensor "
            "(--distribute-saved-activations) passes; view it as the input's shape",
        )


def _cpu_initialized(init):
    """A rotary embedding ``__init__`` that builds its frequency tables on the CPU."""

    @functools.wraps(init)
    def init_on_cpu(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        return init(self, *args, **kwargs)

    return init_on_cpu


def install_in_child() -> PatchManager:
    """``device-compat``'s patches applied in this process (a spawned checkpoint worker, where
    the one line never ran); the manager that holds them."""
    from anyspeed.device import detect

    manager = PatchManager()
    DeviceCompat().register_patches(manager, argparse.Namespace(), detect())
    manager.apply()
    return manager
