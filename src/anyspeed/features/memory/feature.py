"""Level-2 memory features (MindSpeed's flag names), each switched on by its own flag.

* ``recompute-activation-function`` (``--recompute-activation-function``,
  ``--recompute-activation-function-num-layers N``): the MLP activation's output is released
  after fc2 and recomputed in backward (dense MLPs, experts, shared experts; with the level-1
  SwiGLU kernel or without).
* ``recompute-norm`` (``--recompute-norm``, ``--recompute-norm-num-layers N``): the input and
  pre-MLP norm outputs are released and recomputed, also under TP + sequence parallel.
* ``swap-attention`` (``--swap-attention``, ``--swap-modules``): saved activations of the
  chosen modules go to pinned host memory, prefetched back in backward; on the CPU a no-op.
* ``swap-optimizer`` (``--swap-optimizer``, Megatron's ``--optimizer-cpu-offload``): optimizer
  states and fp32 main parameters wait in host memory between steps (:mod:`.offload`); on the
  CPU, where they already live in host memory, a no-op.

Megatron's own recompute (``--recompute-granularity`` ...) is passed through, not a feature.
"""

from __future__ import annotations

import argparse
import functools

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag, dest
from anyspeed.patching import PatchManager

_CHECKPOINT = "megatron.core.tensor_parallel.random.CheckpointWithoutOutput"
_LAYER_INIT = "megatron.core.transformer.transformer_layer.TransformerLayer.__init__"
SWAP_MODULES = ("input_norm", "self_attention", "post_attention_norm")
_SWAP_ATTR = {
    "input_norm": "input_layernorm",
    "self_attention": "self_attention",
    "post_attention_norm": "pre_mlp_layernorm",
}


def _num_layers_flag(parser: argparse._ActionsContainer, flag: str, what: str) -> None:
    add_flag(
        parser,
        flag,
        type=int,
        default=None,
        help=f"{what} only in the first N layers of each model chunk (default: all)",
    )


class RecomputeCompat(Feature):
    name = "recompute-compat"
    level = 0
    description = (
        "Megatron-Core 0.16.1's output-discarding checkpoint without Transformer "
        "Engine (selective layernorm / moe_act recompute and the features above)"
    )

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        from megatron.core.tensor_parallel import random

        return not hasattr(random, "FP8GlobalStateManager")  # TE did not import

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        def wrap(init):
            @functools.wraps(init)
            def __init__(self, fp8=False):
                init(self, fp8)
                self.fp8 = fp8 not in (None, False)  # TE's FP8 state only for a real recipe

            return __init__

        pm.register_wrap(
            _CHECKPOINT + ".__init__",
            wrap,
            feature=self.name,
            reason="CheckpointWithoutOutput() sets fp8 = (False is not None), "
            "then names TE's FP8GlobalStateManager, undefined without TE",
        )


class _LayerRecompute(Feature):
    """A recompute switched on per transformer layer by ``mark`` (see :mod:`.recompute`)."""

    level = 2
    mark_name = ""

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(parser, self.flags[0], action="store_true", help=self.description)
        _num_layers_flag(parser, self.flags[1], self.description.split(":")[0])

    def requested(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, dest(self.flags[0]), False))

    def num_layers(self, args: argparse.Namespace) -> int | None:
        return getattr(args, dest(self.flags[1]), None)

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        n = self.num_layers(args)
        if n is not None and not self.requested(args):
            raise FeatureError(f"{self.flags[1]} needs {self.flags[0]}")
        if n is not None and n < 1:
            raise FeatureError(f"{self.flags[1]} must be >= 1 (got {n})")
        super().validate(args, device)

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        from anyspeed.features.memory import recompute

        mark = getattr(recompute, self.mark_name)
        pm.register_wrap(
            _LAYER_INIT,
            recompute.wrap_layer_init([(mark, self.num_layers(args))]),
            feature=self.name,
            reason=f"mark each new layer for {self.name}",
        )


class RecomputeActivation(_LayerRecompute):
    name = "recompute-activation-function"
    flags = ("--recompute-activation-function", "--recompute-activation-function-num-layers")
    description = (
        "activation recompute: the MLP activation output is released after fc2 and "
        "recomputed in backward (dense MLPs and experts)"
    )
    mark_name = "mark_activation"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        super().register_patches(pm, args, device)
        from anyspeed.features.memory.recompute import wrap_mlp_forward

        pm.register_wrap(
            "megatron.core.transformer.mlp.MLP.forward",
            wrap_mlp_forward,
            feature=self.name,
            reason="fc1 -> checkpointed activation (output "
            "released) -> fc2, for MLPs marked at build",
        )


class RecomputeNorm(_LayerRecompute):
    name = "recompute-norm"
    flags = ("--recompute-norm", "--recompute-norm-num-layers")
    description = (
        "norm recompute: the input and pre-MLP norm outputs are released and "
        "recomputed in backward (Megatron's layernorm recompute, per layer)"
    )
    mark_name = "mark_norms"


class SwapAttention(Feature):
    name = "swap-attention"
    level = 2
    flags = ("--swap-attention", "--swap-modules")
    description = (
        "activations saved by the chosen modules of each layer wait in pinned host "
        "memory, prefetched back in backward"
    )

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(parser, "--swap-attention", action="store_true", help=self.description)
        add_flag(
            parser,
            "--swap-modules",
            default=",".join(SWAP_MODULES),
            help=f"comma-separated, of {', '.join(SWAP_MODULES)} (default: all)",
        )

    def requested(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "swap_attention", False))

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        if device.is_cuda:
            return True, ""
        return True, (
            f"accepted, no effect on {device.type}: activations already live in host "
            "memory (no pinned memory or copy streams to swap with)"
        )

    def modules(self, args: argparse.Namespace) -> list[str]:
        names = [m.strip() for m in (getattr(args, "swap_modules", None) or "").split(",")]
        bad = [m for m in names if m not in SWAP_MODULES]
        if bad or not names:
            raise FeatureError(
                f"--swap-modules: unknown {bad} (choose from {','.join(SWAP_MODULES)})"
            )
        return names

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        if self.requested(args):
            self.modules(args)
        super().validate(args, device)

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if not device.is_cuda:
            return
        attrs = [_SWAP_ATTR[m] for m in self.modules(args)]
        pm.register_wrap(
            _LAYER_INIT,
            functools.partial(_swap_init, attrs=attrs),
            feature=self.name,
            reason="route the chosen modules' saved tensors through the layer's host-memory swap",
        )


def _swap_init(init, attrs: list[str]):
    from anyspeed.features.memory import swap

    state: dict[str, swap.Swapper] = {}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        swapper = state.setdefault("swapper", swap.Swapper())
        layer = swapper.add(self)
        for attr in attrs:
            swap.wrap_module_forward(getattr(self, attr), layer)

    return __init__


class SwapOptimizer(Feature):
    name = "swap-optimizer"
    level = 2
    flags = ("--swap-optimizer", "--swap-optimizer-times", "--optimizer-cpu-offload")
    description = "optimizer state kept in host memory between steps"

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(parser, "--swap-optimizer", action="store_true", help=self.description)
        add_flag(
            parser,
            "--swap-optimizer-times",
            type=int,
            default=16,
            help="MindSpeed's copy granularity (accepted; anyspeed copies tensor by tensor)",
        )
        add_flag(
            parser,
            "--optimizer-cpu-offload",
            action="store_true",
            help="Megatron's name for the same: states in host memory between steps",
        )

    def requested(self, args: argparse.Namespace) -> bool:
        return bool(
            getattr(args, "swap_optimizer", False) or getattr(args, "optimizer_cpu_offload", False)
        )

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        if device.type != "cpu":
            return True, ""
        return True, (
            f"accepted, no effect on {device.type}: optimizer state already lives in "
            "host memory (and pinned memory is unavailable)"
        )

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if device.type == "cpu":
            return
        pm.register_wrap(
            "megatron.core.optimizer.get_megatron_optimizer",
            _offloaded_optimizer,
            feature=self.name,
            reason="keep the new optimizer's states and main parameters in host memory "
            "between steps",
        )


def _offloaded_optimizer(get_megatron_optimizer):
    @functools.wraps(get_megatron_optimizer)
    def build(*args, **kwargs):
        from anyspeed.device import torch_device
        from anyspeed.features.memory.offload import OptimizerOffload

        optimizer = get_megatron_optimizer(*args, **kwargs)
        optimizer.offload = OptimizerOffload(optimizer, torch_device())
        return optimizer

    return build
