"""MindSpeed-LLM's conversion-script flags that describe the training run, in ``anyspeed
convert``.

Its ``ckpt_convert_*_hf2mcore.sh`` / ``*_mcore2hf.sh`` scripts pass the layout the run trains
at (``--moe-grouped-gemm``, ``--expert-tensor-parallel-size``,
``--num-layers-per-virtual-pipeline-stage``, ``--moe-tp-extend-ep``; for mcore -> hf the
``--source-*-parallel-size`` it was saved at) and the model again (``--num-layers``, counting
``--noop-layers`` slots, and ``--first-k-dense-replace``). A torch_dist checkpoint (the default
here) loads at any of those layouts, and the source layout of one is read from the checkpoint,
so the layout flags are accepted with one note; the legacy rank files written here are
sequential experts at expert TP = TP without virtual stages, so asking for another layout there
is one line. The model flags are checked against the model converted.
"""

from __future__ import annotations

import argparse
import sys

from anyspeed.errors import UsageError

_LAYOUT = (
    "moe_grouped_gemm",
    "expert_tensor_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "moe_tp_extend_ep",
)
_SOURCE = (
    "source_tensor_parallel_size",
    "source_pipeline_parallel_size",
    "source_expert_parallel_size",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags, in a group of their own."""
    g = p.add_argument_group("MindSpeed-LLM's run description (checked or noted)")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="the run's grouped experts")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--moe-tp-extend-ep", action="store_true")
    for name in _SOURCE:
        g.add_argument(_flag(name), type=int, default=None, help="mg -> hf: read from the files")
    g.add_argument("--mla-mm-split", action="store_true", help="accepted: an NPU kernel switch")
    g.add_argument("--num-layers", type=int, default=None, help="checked: layers + noop slots")
    g.add_argument("--first-k-dense-replace", type=int, default=None, help="checked")


def check(args: argparse.Namespace) -> None:
    """Before any work: the layout flags against the format, the model flags against the
    model (UsageError, one line); a note for what is accepted."""
    given = [_flag(n) for n in (*_LAYOUT, *_SOURCE) if getattr(args, n)]
    if any(getattr(args, n) for n in _SOURCE) and args.load_model_type != "mg":
        raise UsageError("--source-*-parallel-size describe a Megatron --load-dir (mg -> hf)")
    etp = args.expert_tensor_parallel_size
    legacy_other = [
        f
        for f, other in (
            ("--moe-grouped-gemm", args.moe_grouped_gemm),
            ("--expert-tensor-parallel-size", etp not in (None, args.target_tensor_parallel_size)),
            ("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage),
            ("--moe-tp-extend-ep", args.moe_tp_extend_ep),
        )
        if other
    ]
    if args.ckpt_format == "legacy" and args.save_model_type == "mg" and legacy_other:
        raise UsageError(
            f"{legacy_other[0]}: the legacy rank files written here hold sequential experts at "
            "expert TP = TP without virtual stages; use --ckpt-format torch_dist (the "
            "default), which a run loads at any of these layouts"
        )
    if args.num_layers is not None or args.first_k_dense_replace is not None:
        _check_model(args)
    if given:
        print(
            f"anyspeed convert: note: {' '.join(given)} accepted: a torch_dist checkpoint "
            "loads at any layout, and a Megatron checkpoint's own layout is read from it",
            file=sys.stderr,
        )


def _check_model(args: argparse.Namespace) -> None:
    """``--num-layers`` (the model's layers plus ``--noop-layers`` slots, MindSpeed's rule)
    and ``--first-k-dense-replace`` against the model converted."""
    model = _model(args)
    if model is None:
        return  # a vision-language or unreadable source: the conversion names the problem
    slots = len([x for x in (args.noop_layers or "").split(",") if x.strip()])
    if args.num_layers is not None and args.num_layers != model.num_layers + slots:
        extra = f" + {slots} --noop-layers slots" if slots else ""
        raise UsageError(
            f"--num-layers {args.num_layers}: the model has {model.num_layers} layers{extra}"
        )
    k = args.first_k_dense_replace
    if k is not None:
        moe = model.moe_layers()
        dense_first = next((i for i, m in enumerate(moe) if m), len(moe))
        if (max(k, 0), all(moe[dense_first:])) != (dense_first, True):
            raise UsageError(
                f"--first-k-dense-replace {k}: the model's MoE layers are "
                f"{[i for i, m in enumerate(moe) if m] or 'none'}"
            )


def _model(args: argparse.Namespace):  # noqa: ANN202 - a ModelConfig or None
    from anyspeed.convert import ConvertError

    try:
        if args.load_model_type == "hf":
            from anyspeed.convert.hf_io import read_config, vlm_architecture
            from anyspeed.models.hf import preset_from_hf

            if vlm_architecture(read_config(args.load_dir, raw=True)):
                return None
            return preset_from_hf(read_config(args.load_dir))
        from anyspeed.checkpoint.reads import tracked_dir
        from anyspeed.checkpoint.record import read_model

        path = tracked_dir(args.load_dir)
        return read_model(path) if path else None
    except (ConvertError, UsageError, ValueError, OSError):
        return None  # the conversion itself names what is wrong with the source
