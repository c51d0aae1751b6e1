"""Level-0 features for Megatron-LM's own training stack (``megatron.training``).

* ``megatron-lm-args``: anyspeed's flags join Megatron-LM's argument parser, and anyspeed's
  validation runs inside Megatron's ``validate_args`` (before any process group starts), with a
  one-line error instead of a traceback.
* ``megatron-lm-compat``: the CUDA-only steps of ``megatron.training`` on other devices: the
  "Megatron requires CUDA" assert, the fused-kernel build, CUDA JIT warm-up, a Triton-only module
  imported at the top of ``initialize.py``, and CUDA-only defaults (gradient-accumulation fusion,
  ``--transformer-impl transformer_engine`` when TE is absent, CUDA fusions) switched off with a
  note. Both are enabled only when ``megatron.training`` is importable (a Megatron-LM checkout).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import types

from anyspeed.device import DeviceInfo
from anyspeed.features import Feature, FeatureError, register_feature
from anyspeed.patching import PatchManager


def megatron_lm_available() -> bool:
    """Whether ``megatron.training`` (only in a Megatron-LM checkout) can be imported."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _note(msg: str) -> None:
    if _rank0():
        print(f"anyspeed: {msg}", flush=True)


class MegatronLMArgs(Feature):
    name = "megatron-lm-args"
    level = 0
    description = "anyspeed flags in Megatron-LM's parser; anyspeed validation in validate_args"

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        if megatron_lm_available():
            return True, ""
        return False, "megatron.training not importable (needs a Megatron-LM checkout)"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        from anyspeed import features as F

        def parse_wrapper(parse_args):
            @functools.wraps(parse_args)
            def parse_args_with_anyspeed(extra_args_provider=None, ignore_unknown_args=False):
                def provider(parser):
                    if extra_args_provider is not None:
                        parser = extra_args_provider(parser)
                    return F.add_arguments(parser)

                return parse_args(provider, ignore_unknown_args)

            return parse_args_with_anyspeed

        def validate_wrapper(validate_args):
            @functools.wraps(validate_args)
            def validate_args_with_anyspeed(args, defaults=None):
                import anyspeed.megatron_adaptor as adaptor

                try:
                    adapt_megatron_args(args, device)
                    adaptor.apply(args)  # anyspeed's checks first: they name the flag
                    _context_parallel_args(args)
                    out = validate_args(args, defaults or {})
                except FeatureError as exc:
                    print(f"anyspeed: error: {exc}", file=sys.stderr, flush=True)
                    raise SystemExit(2) from None
                except AssertionError as exc:
                    # Megatron's own argument asserts: one line, still before process groups.
                    print(
                        f"anyspeed: error: Megatron-LM rejected the arguments: {exc}",
                        file=sys.stderr,
                        flush=True,
                    )
                    raise SystemExit(2) from None
                return out

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


# Megatron-LM defaults that select CUDA kernels; off CUDA they are switched off with a note.
_CUDA_DEFAULTS = (
    ("gradient_accumulation_fusion", "needs the fused_weight_gradient_mlp_cuda kernel"),
    ("masked_softmax_fusion", "CUDA softmax kernel"),
    ("bias_gelu_fusion", "torch.compile'd CUDA fusion"),
    ("bias_swiglu_fusion", "torch.compile'd CUDA fusion"),
    ("bias_dropout_fusion", "torch.compile'd CUDA fusion"),
    ("apply_rope_fusion", "TE/apex RoPE kernel"),
    ("persist_layer_norm", "apex persistent LayerNorm kernel"),
)


def _context_parallel_args(args: argparse.Namespace) -> None:
    """MindSpeed's CP flags in Megatron-LM's terms: cp_comm_type and, for hybrid, the
    hierarchical CP sizes [Ulysses degree, ring size] that initialize_model_parallel reads."""
    from anyspeed.features.context_parallel.feature import ALGO_TO_COMM

    cp = getattr(args, "context_parallel_size", 1) or 1
    algo = getattr(args, "context_parallel_algo", None)
    if cp <= 1 or algo not in ALGO_TO_COMM:
        return
    args.cp_comm_type = [ALGO_TO_COMM[algo]]
    degree = getattr(args, "ulysses_degree_in_cp", None)
    if algo == "hybrid_cp_algo" and degree:
        args.hierarchical_context_parallel_sizes = [degree, cp // degree]


def adapt_megatron_args(args: argparse.Namespace, device: DeviceInfo) -> None:
    """Turn Megatron-LM defaults that need CUDA-only kernels off on other devices (with notes)."""
    if device.is_cuda:
        return
    # validate_args asks for this when TP > 1 on pre-Blackwell "GPUs"; it means nothing here.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    changed = []
    for attr, why in _CUDA_DEFAULTS:
        if getattr(args, attr, False):
            setattr(args, attr, False)
            changed.append(f"{attr} ({why})")
    if getattr(args, "no_persist_layer_norm", None) is False:
        args.no_persist_layer_norm = True
    if getattr(args, "transformer_impl", None) == "transformer_engine" and (
        importlib.util.find_spec("transformer_engine") is None
    ):
        args.transformer_impl = "local"
        changed.append("transformer_impl -> local (Transformer Engine is not installed)")
    if changed:
        _note(f"on {device.type}, switched off CUDA-only defaults: " + "; ".join(changed))


def compile_dataset_helpers() -> None:
    """Run Megatron's dataset-helper ``make`` with this interpreter's headers and suffix."""
    import subprocess
    import sysconfig

    import megatron.core.datasets.utils as mutils

    directory = os.path.dirname(os.path.abspath(mutils.__file__))
    includes = [sysconfig.get_paths()["include"]]
    try:
        import pybind11

        includes.append(pybind11.get_include())
    except ImportError:
        raise SystemExit(
            "anyspeed: error: building Megatron's dataset helpers needs pybind11: "
            "pip install pybind11"
        ) from None
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    cmd = [
        "make",
        "-C",
        directory,
        f"LIBEXT={suffix}",
        "CPPFLAGS=" + " ".join(f"-I{i}" for i in includes),
    ]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"anyspeed: error: building Megatron's dataset helpers failed: {cmd}")


def _standin_module(name: str, why: str):
    def factory(error: BaseException) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__doc__ = f"anyspeed stand-in: the real module failed to import ({error})."

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name} is unavailable on this device: {why} ({error})")

        def is_disabled(*args, **kwargs):
            return False

        def module_getattr(attr: str):
            if attr.startswith("__"):  # keep introspection (inspect, pickle) working
                raise AttributeError(attr)
            return is_disabled if attr.startswith("is_") else unavailable

        mod.__getattr__ = module_getattr  # type: ignore[attr-defined]
        return mod

    return factory


class MegatronLMCompat(Feature):
    name = "megatron-lm-compat"
    level = 0
    description = "megatron.training's CUDA-only steps handled on this device"

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        if not megatron_lm_available():
            return False, "megatron.training not importable (needs a Megatron-LM checkout)"
        return True, "no-op on CUDA" if device.is_cuda else ""

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        return not device.is_cuda and megatron_lm_available()

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if importlib.util.find_spec("triton") is None:
            pm.register_module_fallback(
                "megatron.core.transformer.custom_layers.batch_invariant_kernels",
                _standin_module("batch-invariant kernels", "they are Triton GPU kernels"),
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
            compile_dataset_helpers,
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


MEGATRON_LM_ARGS = register_feature(MegatronLMArgs())
MEGATRON_LM_COMPAT = register_feature(MegatronLMCompat())
