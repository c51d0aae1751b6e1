"""Level-0 features for Megatron-LM's own training stack (``megatron.training``).

* ``megatron-lm-args``: anyspeed's flags join Megatron-LM's argument parser, and anyspeed's
  validation runs inside Megatron's ``validate_args`` (before any process group starts), with a
  one-line error instead of a traceback.
* ``megatron-lm-compat``: the CUDA-only steps of ``megatron.training`` on other devices: the
  "Megatron requires CUDA" assert, the fused-kernel build, CUDA JIT warm-up, a Triton-only module
  imported at the top of ``initialize.py``, and CUDA-only defaults (gradient-accumulation fusion,
  ``--transformer-impl transformer_engine`` when TE is absent, CUDA fusions) switched off with a
  note. Both are enabled only when ``megatron.training`` is importable (a Megatron-LM checkout).

These are the only features that touch ``megatron.training``; the helpers are in
:mod:`.megatron_lm_steps`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from collections.abc import Callable
from typing import Any, NoReturn

from anyspeed.device import DeviceInfo
from anyspeed.errors import UsageError, report
from anyspeed.features.base import Feature, FeatureError
from anyspeed.features.compat import megatron_lm_steps as steps
from anyspeed.features.compat.rope_scaling_flags import refuse_longrope_in_megatron_lm
from anyspeed.features.pipeline.feature import refuse_in_megatron_lm
from anyspeed.patching import PatchManager

_NEEDS_CHECKOUT = "megatron.training not importable (needs a Megatron-LM checkout)"


def _fail(message: str) -> NoReturn:
    raise SystemExit(report("anyspeed", UsageError(message))) from None


class MegatronLMArgs(Feature):
    name = "megatron-lm-args"
    level = 0
    description = "anyspeed flags in Megatron-LM's parser; anyspeed validation in validate_args"
    # Validates and applies Megatron-LM's parsed namespace. Set by anyspeed.adaptor before it
    # registers this feature's patches (handed in, so the features never import the adaptor).
    apply_args: Callable[[argparse.Namespace], object] | None = None

    def __init__(self, add_flags: Callable[[Any], Any]) -> None:
        # adds every feature's flags to a parser: handed in by the registry, which holds them
        self.add_flags = add_flags

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        return (True, "") if steps.megatron_lm_available() else (False, _NEEDS_CHECKOUT)

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        feature = self

        def parse_wrapper(parse_args):
            @functools.wraps(parse_args)
            def parse_args_with_anyspeed(extra_args_provider=None, ignore_unknown_args=False):
                def provider(parser):
                    if extra_args_provider is not None:
                        parser = extra_args_provider(parser)
                    return feature.add_flags(parser)

                return parse_args(provider, ignore_unknown_args)

            return parse_args_with_anyspeed

        def validate_wrapper(validate_args):
            @functools.wraps(validate_args)
            def validate_args_with_anyspeed(args, defaults=None):
                if feature.apply_args is None:
                    raise RuntimeError("megatron-lm-args: the adaptor did not hand in apply_args")
                try:
                    refuse_in_megatron_lm(args)
                    refuse_longrope_in_megatron_lm(args)
                    steps.adapt_megatron_args(args, device)
                    feature.apply_args(args)  # anyspeed's checks first: they name the flag
                    steps.placement_layout_args(args)
                    steps.context_parallel_args(args)
                    with steps.grouped_gemm_capability(args, device):
                        out = validate_args(args, defaults or {})
                    steps.drop_stream_priorities(args, device)
                    return out
                except FeatureError as exc:
                    _fail(str(exc))
                except AssertionError as exc:
                    # Megatron's own argument asserts: one line, still before process groups.
                    _fail(f"Megatron-LM rejected the arguments: {exc}")

            return validate_args_with_anyspeed

        pm.register_wrap(
            "megatron.training.arguments.parse_args",
            parse_wrapper,
            feature=self.name,
            reason="register anyspeed flags with Megatron-LM",
        )
        pm.register_wrap(
            "megatron.training.arguments.validate_args",
            validate_wrapper,
            feature=self.name,
            reason="run anyspeed validation before process groups start",
        )


class MegatronLMCompat(Feature):
    name = "megatron-lm-compat"
    level = 0
    description = "megatron.training's CUDA-only steps handled on this device"

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        if not steps.megatron_lm_available():
            return False, _NEEDS_CHECKOUT
        return True, "no-op on CUDA" if device.is_cuda else ""

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        return not device.is_cuda and steps.megatron_lm_available()

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if importlib.util.find_spec("triton") is None:
            pm.register_module_fallback(
                "megatron.core.transformer.custom_layers.batch_invariant_kernels",
                steps.standin_module("batch-invariant kernels", "they are Triton GPU kernels"),
                feature=self.name,
                reason="imported by megatron.training.initialize but needs triton (GPU only); "
                "a stand-in keeps the import working and errors if batch-invariant mode is used",
            )

        def allow_no_cuda(initialize_megatron):
            @functools.wraps(initialize_megatron)
            def initialize_megatron_any_device(*a, **kw):
                kw["allow_no_cuda"] = True
                return initialize_megatron(*a, **kw)

            return initialize_megatron_any_device

        pm.register_wrap(
            "megatron.training.initialize.initialize_megatron",
            allow_no_cuda,
            feature=self.name,
            reason="skip the 'Megatron requires CUDA' assert: the device layer provides torch.cuda",
        )
        pm.register_replace(
            "megatron.legacy.fused_kernels.load",
            lambda args: None,
            feature=self.name,
            reason="Megatron's fused CUDA kernels cannot be built without CUDA; nothing to load",
        )
        pm.register_replace(
            "megatron.core.datasets.utils.compile_helpers",
            steps.compile_dataset_helpers,
            feature=self.name,
            reason="build the dataset index helpers for the running interpreter (Megatron's "
            "Makefile asks whichever python3 is first on PATH)",
        )
        pm.register_replace(
            "megatron.training.initialize._warmup_jit_function",
            lambda: None,
            feature=self.name,
            reason="warms up CUDA JIT fusions that are switched off on this device",
        )
