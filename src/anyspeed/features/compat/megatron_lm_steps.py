"""What ``megatron.training`` needs on a non-CUDA device: its arguments adapted, its CUDA-only
start-up steps replaced, a Triton-only module stood in for. Used by :mod:`.megatron_lm`."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import types
from collections.abc import Callable, Iterator

from anyspeed.device import DeviceInfo
from anyspeed.layout import CPAlgo


def megatron_lm_available() -> bool:
    """Whether ``megatron.training`` (only in a Megatron-LM checkout) can be imported."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def _note(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"anyspeed: {msg}", flush=True)


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


def drop_stream_priorities(args: argparse.Namespace, device: DeviceInfo) -> None:
    """Off CUDA, no process group gets NCCL options: validate_args asks high-priority NCCL
    streams for the data-parallel group with FSDP, and making them needs ProcessGroupNCCL."""
    if not device.is_cuda and getattr(args, "high_priority_stream_groups", None):
        args.high_priority_stream_groups = []


def adapt_megatron_args(args: argparse.Namespace, device: DeviceInfo) -> None:
    """Turn Megatron-LM defaults that need CUDA-only kernels off on other devices (with notes)."""
    if device.is_cuda:
        return
    # validate_args asks for "1" when TP > 1 on pre-Blackwell "GPUs", and for anything but "1"
    # with FSDP (where TP needs nothing); it means nothing here.
    fsdp = getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)
    if fsdp:
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    else:
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


def placement_layout_args(args: argparse.Namespace) -> None:
    """anyspeed's own placement (``--noop-layers``, already rewritten to the real layers and a
    tuple of slots; a ``--num-layer-list`` of unequal middle stages) as Megatron's own
    ``--pipeline-model-parallel-layout``: each stage's real layers, the embedding first, MTP
    and the loss last. Megatron then numbers the real layers itself."""
    noop, listed = getattr(args, "noop_layers", None), getattr(args, "num_layer_list", None)
    if not (noop or listed) or getattr(args, "pipeline_model_parallel_layout", None):
        return
    from anyspeed.layout import Layout

    per_stage = Layout.from_args(args).virtual_stage_layers(args.num_layers)
    stages = ["t" * n for n in per_stage]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * (getattr(args, "mtp_num_layers", None) or 0) + "L"
    args.pipeline_model_parallel_layout = "|".join(stages)
    args.num_layers_per_virtual_pipeline_stage = None
    args.num_virtual_stages_per_pipeline_rank = None
    args.virtual_pipeline_model_parallel_size = None  # Megatron derives it from the layout
    args.decoder_first_pipeline_num_layers = None
    args.decoder_last_pipeline_num_layers = None
    args.num_layer_list = None


def context_parallel_args(args: argparse.Namespace) -> None:
    """MindSpeed's CP flags in Megatron-LM's terms: cp_comm_type and, for hybrid, the
    hierarchical CP sizes [Ulysses degree, ring size] that initialize_model_parallel reads."""
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp <= 1:
        return
    algo = CPAlgo.parse(getattr(args, "context_parallel_algo", None))
    args.cp_comm_type = [algo.value]
    degree = getattr(args, "ulysses_degree_in_cp", None)
    if algo is CPAlgo.HYBRID and degree:
        args.hierarchical_context_parallel_sizes = [degree, cp // degree]


@contextlib.contextmanager
def grouped_gemm_capability(args: argparse.Namespace, device: DeviceInfo) -> Iterator[None]:
    """Megatron-LM's ``validate_args`` asserts a GPU of compute capability >= 8 for
    ``--moe-grouped-gemm`` (its CUDA grouped_gemm kernels); anyspeed's portable kernel needs none,
    so off CUDA the flag is hidden from that one check and restored afterwards."""
    hide = not device.is_cuda and bool(getattr(args, "moe_grouped_gemm", False))
    if hide:
        args.moe_grouped_gemm = False
    try:
        yield
    finally:
        if hide:
            args.moe_grouped_gemm = True


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


def standin_module(name: str, why: str) -> Callable[[BaseException], types.ModuleType]:
    """A factory of a module that imports fine and raises a clear error when actually used."""

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
