"""Level-1 feature ``fp8``: Megatron's ``--fp8-format`` without Transformer Engine.

Megatron-Core's FP8 lives in Transformer Engine's modules; its local layers ignore the flag.
Here the flag works on every device: the linear layers of each transformer layer (attention's
QKV and output projections, the MLP's and experts' FC1/FC2, MLA's projections) run their
forward, input-gradient and weight-gradient GEMMs on FP8 operands with per-tensor scales
(:mod:`.linear`); embeddings, the output layer, norms, attention scores and the router stay in
the run's precision, as with Transformer Engine. Recipes ``tensorwise`` (current scaling) and
``delayed`` (amax history, Megatron's default); formats ``e4m3`` and ``hybrid`` (e5m2
gradients). On CUDA devices with FP8 tensor cores the GEMMs are ``torch._scaled_mm``; elsewhere
they are emulated exactly (FP8 values multiplied in bf16/fp32), to check a recipe's numerics.

The settings ride on ``TransformerConfig``'s own fp8 fields, which are moved aside before
Megatron's checks (so none of its Transformer-Engine-only FP8 paths is taken) and read back when
a ``TransformerBlock`` is built.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from typing import Any

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag, level_of
from anyspeed.features.fp8.settings import AMAX_ALGOS, FORMATS, RECIPES, Fp8Settings
from anyspeed.patching import PatchManager

_CONFIG = "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"
_BLOCK = "megatron.core.transformer.transformer_block.TransformerBlock.__init__"
_LINEAR_MODULES = {"mlp", "moe", "shared_experts", "mla_up_proj"}  # selective recompute


def _recomputes_linears(args: argparse.Namespace) -> bool:
    """Whether Megatron's recompute re-runs linear layers (full, or a selective module with
    linears; ``core_attn``, ``layernorm`` and ``moe_act`` have none)."""
    granularity = getattr(args, "recompute_granularity", None)
    modules = set(getattr(args, "recompute_modules", None) or ["core_attn"])
    return granularity == "full" or (granularity == "selective" and bool(modules & _LINEAR_MODULES))


def _te_owns(args: argparse.Namespace) -> bool:
    """Whether Transformer Engine's own FP8 runs this (its layers, installed)."""
    return getattr(args, "transformer_impl", None) == "transformer_engine" and bool(
        importlib.util.find_spec("transformer_engine")
    )


def _settings_aside(post_init: Any) -> Any:
    def __post_init__(config: Any) -> None:
        settings = Fp8Settings.from_config(config)
        if settings is not None:
            config.fp8 = None  # Megatron's FP8 paths need Transformer Engine
        post_init(config)
        config.anyspeed_fp8 = settings

    return functools.wraps(post_init)(__post_init__)


def _fp8_layers(init: Any) -> Any:
    from anyspeed.features.fp8.linear import install_block

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        settings = getattr(self.config, "anyspeed_fp8", None)
        if settings is not None:
            install_block(self, settings)

    return functools.wraps(init)(__init__)


class Fp8(Feature):
    name = "fp8"
    level = 1
    description = (
        "FP8 GEMMs in the transformer layers' linears without Transformer Engine "
        "(per-tensor scales; torch._scaled_mm on FP8 GPUs, exact emulation elsewhere)"
    )
    flags = (
        "--fp8-format",
        "--fp8-recipe",
        "--fp8-margin",
        "--fp8-amax-history-len",
        "--fp8-amax-compute-algo",
        "--no-fp8-wgrad",
        "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16",
        "--num-layers-at-end-in-bf16",
    )

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        """Megatron-LM's names, destinations, choices and defaults."""
        fmt_help = "FP8 GEMMs: e4m3 everywhere, or hybrid (e5m2 gradients)"
        add_flag(parser, "--fp8-format", dest="fp8", choices=FORMATS, default=None, help=fmt_help)
        recipes = (*RECIPES, "mxfp8", "blockwise", "custom")
        recipe_help = "scaling: tensorwise (current) or delayed (amax history)"
        add_flag(parser, "--fp8-recipe", choices=recipes, default="delayed", help=recipe_help)
        add_flag(parser, "--fp8-margin", type=int, default=0)
        add_flag(parser, "--fp8-amax-history-len", type=int, default=1)
        add_flag(parser, "--fp8-amax-compute-algo", choices=AMAX_ALGOS, default="most_recent")
        add_flag(parser, "--no-fp8-wgrad", dest="fp8_wgrad", action="store_false", default=True)
        add_flag(parser, "--first-last-layers-bf16", action="store_true")
        add_flag(parser, "--num-layers-at-start-in-bf16", type=int, default=1)
        add_flag(parser, "--num-layers-at-end-in-bf16", type=int, default=1)

    def requested(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "fp8", None)) and not _te_owns(args)

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        if not self.requested(args):
            return
        if level_of(args) < self.level:
            raise FeatureError(
                f"--fp8-format needs --optimization-level {self.level} or higher "
                f"(got {level_of(args)}): FP8 GEMMs are a level-1 kernel here"
            )
        recipe = getattr(args, "fp8_recipe", "delayed")
        if recipe not in RECIPES:
            raise FeatureError(
                f"--fp8-recipe {recipe} needs Transformer Engine (mxfp8: Blackwell GPUs); "
                "without it anyspeed runs --fp8-recipe tensorwise or delayed"
            )
        if getattr(args, "fp8_param_gather", False):
            raise FeatureError(
                "--fp8-param-gather needs Transformer Engine's FP8 parameters: remove it "
                "(anyspeed's FP8 keeps the weights in the run's precision)"
            )
        if recipe == "delayed" and _recomputes_linears(args):
            raise FeatureError(
                "--fp8-recipe delayed with recompute of linear layers would update the amax "
                "history twice a step: use --fp8-recipe tensorwise"
            )
        if getattr(args, "moe_grouped_gemm", False):
            raise FeatureError(
                "--fp8-format with --moe-grouped-gemm: anyspeed's FP8 covers the experts' own "
                "linears; remove --moe-grouped-gemm (each expert then runs FP8 GEMMs)"
            )
        for flag in ("--fp8-margin", "--fp8-amax-history-len"):
            value = getattr(args, flag[2:].replace("-", "_"), None)  # absent: its default
            if value is not None and value < (1 if "history" in flag else 0):
                raise FeatureError(f"{flag} must be >= {1 if 'history' in flag else 0}")

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        why = "move the fp8 fields aside before Megatron's TE-only FP8 paths read them"
        pm.register_wrap(_CONFIG, _settings_aside, feature=self.name, reason=why)
        why = "FP8 GEMMs in the transformer layers' Column/RowParallelLinear"
        pm.register_wrap(_BLOCK, _fp8_layers, feature=self.name, reason=why)
