"""``anyspeed convert``: MindSpeed-LLM's ``convert_ckpt_v2.py`` flags, HF <-> Megatron.

    anyspeed convert --load-model-type hf --save-model-type mg --load-dir HF --save-dir MG \\
        [--target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 --ckpt-format legacy]
    anyspeed convert --load-model-type mg --save-model-type hf --load-dir MG --save-dir HF \\
        [--hf-cfg-dir HF_ORIGINAL_OR_TOKENIZER] [--model-type-hf llama2]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from anyspeed import quiet
from anyspeed.checkpoint.megatron_lm_args import MODEL_TYPE_HF
from anyspeed.commands import convert_flags
from anyspeed.convert.api import DTYPES
from anyspeed.errors import OneLineArgumentParser, UsageError, report

PROG = "anyspeed convert"


def build_parser() -> argparse.ArgumentParser:
    """The flags of MindSpeed-LLM's converter that apply here (errors are one line)."""
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load-model-type", choices=["hf", "mg"], required=True)
    p.add_argument("--save-model-type", choices=["hf", "mg"], required=True)
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True, help="must not exist yet")
    p.add_argument(
        "--model-type-hf",
        choices=sorted(MODEL_TYPE_HF),
        help="the HF family: checked against config.json (hf -> mg) or the checkpoint's model; "
        "names the family of a Megatron-LM checkpoint (mg -> hf; default: inferred)",
    )
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument(
        "--target-expert-parallel-size",
        type=int,
        default=1,
        help="expert-parallel ranks of the legacy layout (torch_dist: any)",
    )
    p.add_argument("--ckpt-format", choices=["torch_dist", "legacy"], default="torch_dist")
    p.add_argument(
        "--num-layer-list", default=None, help="layers per pipeline stage, comma-separated (legacy)"
    )
    p.add_argument(
        "--noop-layers",
        default=None,
        help="MindSpeed's empty layer slots, 0-based among the model's layers plus these "
        "(legacy: they move the stage boundaries; torch_dist loads with or without them)",
    )
    p.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="multi-token prediction layers to convert (hf -> mg; default: every one "
        "the checkpoint holds; 0 leaves them out)",
    )
    p.add_argument(
        "--hf-cfg-dir",
        help="HF directory whose config.json and tokenizer files "
        "go with the converted weights (mg -> hf)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=1,
        help="pad the vocabulary to a multiple of this x the target TP size",
    )
    p.add_argument(
        "--params-dtype",
        choices=sorted(DTYPES),
        help="cast the weights (default: keep the source dtype)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (mg -> hf)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="run both models on the same random tokens; fail above the tolerance",
    )
    p.add_argument("--verify-tolerance", type=float, default=1e-4)
    g = p.add_argument_group("LoRA (mg -> hf)")
    g.add_argument(
        "--lora-load",
        help="a LoRA checkpoint of `anyspeed posttrain`: merged into "
        "the --load-dir weights (or exported alone with --save-lora-to-hf)",
    )
    g.add_argument("--lora-r", type=int, default=None, help="checked against the checkpoint")
    g.add_argument("--lora-alpha", type=float, default=None, help="checked against it")
    g.add_argument("--lora-target-modules", nargs="*", default=None, help="checked against it")
    g.add_argument(
        "--save-lora-to-hf",
        action="store_true",
        help="write the adapters in PEFT's format instead of merging them",
    )
    convert_flags.add_arguments(p)
    return p


def reuse_freed_memory() -> None:
    """Have glibc keep freed blocks of up to 32 MiB for reuse, in one arena.

    A conversion allocates and frees tensors of the same sizes, layer after layer. By default
    glibc returns every block above its adaptive mmap threshold to the kernel, and tensors made
    in the reading thread live in another arena, so each new tensor costs a page fault per
    4 KiB. For torch_dist -> HF of Qwen2.5-1.5B that was 600-840k faults; with this it is
    230-390k, and the conversion takes 2.4-2.7 s instead of 2.7-6.1 s. This is process-wide,
    so only the command-line entry calls it. Elsewhere than glibc it does nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8
    mallopt(m_arena_max, 1)
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's upper limit for this setting
    mallopt(m_trim_threshold, 2**31 - 1)
    mallopt(m_top_pad, 256 << 20)


def check_save_dir(save_dir: str) -> None:
    """``--save-dir`` must not exist and must be creatable: a read-only parent is one line
    before any work, not a traceback after the weights were read."""
    from anyspeed.convert import ConvertError

    path = Path(save_dir)
    if path.exists() or path.is_symlink():
        raise ConvertError(f"--save-dir {save_dir} already exists (nothing was written)")
    parent = path.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=parent))
    except OSError as exc:
        raise ConvertError(
            f"--save-dir {save_dir}: cannot create it in {parent} "
            f"({exc.strerror or exc}); choose a writable directory"
        ) from None


def check_args(args: argparse.Namespace) -> None:
    """The flags' values that can be checked before any work (ConvertError, one line)."""
    from anyspeed.convert.hf_io import parse_size

    parse_size(args.max_shard_size)
    check_save_dir(args.save_dir)
    if (args.lora_load or args.save_lora_to_hf) and args.load_model_type != "mg":
        raise UsageError(
            "--lora-load/--save-lora-to-hf convert a Megatron checkpoint: use "
            "--load-model-type mg --save-model-type hf"
        )
    if args.lora_load and args.verify:
        raise UsageError(
            "--verify compares against the unmerged checkpoint: drop it with --lora-load"
        )
    if args.save_lora_to_hf and not args.lora_load:
        raise UsageError("--save-lora-to-hf needs --lora-load (the LoRA checkpoint)")
    convert_flags.check(args)


def main(argv: list[str] | None = None) -> int:
    """``anyspeed convert``: 0 on success; a one-line error on stderr and 2 for a bad command
    line, 1 for bad input."""
    quiet.install()
    try:
        args = build_parser().parse_args(argv)
        check_args(args)
    except UsageError as exc:
        return report(PROG, exc)
    reuse_freed_memory()
    direction = (args.load_model_type, args.save_model_type)
    if (direction == ("hf", "mg") and args.ckpt_format == "torch_dist") or args.verify:
        from anyspeed import adaptor

        # The patches first: on a device without CUDA they keep Megatron's jit_fuser from
        # importing TorchDynamo (1.3 s of a 4 s conversion of a tiny model), then Megatron-Core,
        # both loaded before the freeze.
        adaptor.apply(argv=[])
        import megatron.core.models.gpt  # noqa: F401
    # The interpreter's ~1M objects of torch and Megatron are never garbage: frozen for the
    # conversion, the garbage collector's full passes skip them (0.2 s of a 1.7 s conversion of
    # Qwen2.5-1.5B). Unfrozen at the end, for a caller that goes on in this process.
    gc.freeze()
    try:
        return _run(args, direction)
    finally:
        gc.unfreeze()


def _hf_to_mg(args: argparse.Namespace) -> None:
    """HF -> Megatron with the command's flags; a line when the HF directory is read as the
    text model of a vision-language checkpoint."""
    from anyspeed.convert import hf_to_megatron
    from anyspeed.convert.hf_io import text_model_note

    hf_to_megatron(
        args.load_dir,
        args.save_dir,
        tp=args.target_tensor_parallel_size,
        pp=args.target_pipeline_parallel_size,
        ckpt_format=args.ckpt_format,
        model_type_hf=args.model_type_hf,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        params_dtype=args.params_dtype,
        num_layer_list=args.num_layer_list,
        noop_layers=args.noop_layers,
        ep=args.target_expert_parallel_size,
        mtp_num_layers=args.mtp_num_layers,
    )
    note = text_model_note(args.load_dir)
    if note:
        print(f"anyspeed convert: {note}")


def _run(args: argparse.Namespace, direction: tuple[str, str]) -> int:
    """The conversion (and ``--verify``) that ``main`` set up."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from anyspeed.convert import ConvertError, megatron_to_hf, verify

    start = time.perf_counter()
    try:
        both = direction in (("hf", "mg"), ("mg", "hf"))
        multimodal = _multimodal_api(args) if both else None  # its config or record says
        if multimodal is not None:
            hf_dir, mg_dir = _multimodal(args, direction, multimodal)
        elif direction == ("hf", "mg"):
            _hf_to_mg(args)
            hf_dir, mg_dir = args.load_dir, args.save_dir
        elif direction == ("mg", "hf") and args.save_lora_to_hf:
            from anyspeed.convert.lora import save_lora_to_hf

            save_lora_to_hf(_lora(args), args.save_dir, args.model_type_hf)
            hf_dir, mg_dir = None, args.load_dir
        elif direction == ("mg", "hf"):
            megatron_to_hf(
                args.load_dir,
                args.save_dir,
                args.hf_cfg_dir,
                max_shard_size=args.max_shard_size,
                model_type_hf=args.model_type_hf,
                lora=_lora(args) if args.lora_load else None,
            )
            hf_dir, mg_dir = args.save_dir, args.load_dir
        else:
            raise ConvertError(
                f"--load-model-type {args.load_model_type} --save-model-type "
                f"{args.save_model_type}: convert hf -> mg or mg -> hf"
            )
        print(f"anyspeed convert: wrote {args.save_dir} in {time.perf_counter() - start:.1f}s")
        if args.verify:
            if multimodal is not None:
                diff = multimodal.verify(hf_dir, mg_dir, tolerance=args.verify_tolerance)
            else:
                diff = verify(hf_dir, mg_dir, tolerance=args.verify_tolerance)
            print(
                f"anyspeed convert: verify max-abs logits difference {diff:.3g} "
                f"(tolerance {args.verify_tolerance:g})"
            )
    except UsageError as exc:  # bad input (a checkpoint's too)
        return report(PROG, exc, code=1)
    except OSError as exc:  # a file error: which file, or where the output was going
        where = exc.filename or f"converting to --save-dir {args.save_dir}"
        return report(PROG, UsageError(f"{where}: {exc.strerror or exc}"), code=1)
    except (Exception, CheckpointException) as exc:  # a writer's wrapper around a file error
        from anyspeed.checkpoint.checks import describe_save_failure, root_cause

        where = os.path.dirname(os.path.abspath(args.save_dir))
        said = describe_save_failure(where, exc)  # the OS error, or a 1 MiB probe write's
        if not isinstance(root_cause(exc), OSError) and not said.startswith("[Errno"):
            raise  # not a file error: a bug to see whole
        return report(
            PROG,
            UsageError(
                f"could not write --save-dir {args.save_dir}: {said}; nothing was kept there"
            ),
            code=1,
        )
    return 0


def _lora(args: argparse.Namespace) -> dict:
    return {
        "load": args.lora_load,
        "r": args.lora_r,
        "alpha": args.lora_alpha,
        "target_modules": args.lora_target_modules,
    }


def _multimodal_api(args: argparse.Namespace) -> Any:
    """The conversion module of the vision-language model ``--load-dir`` holds (LLaVA or
    Qwen-VL); None for a language model."""
    from anyspeed.convert import llava_api, qwen_vl_api

    if llava_api.holds_llava(args.load_dir, args.load_model_type):
        return llava_api
    if qwen_vl_api.holds_qwen_vl(args.load_dir, args.load_model_type):
        return qwen_vl_api
    return None


def _multimodal(
    args: argparse.Namespace, direction: tuple[str, str], api: Any
) -> tuple[str | None, str]:
    """A vision-language model converted by ``api``; (HF dir, Megatron dir) for ``--verify``.
    ConvertError for a flag these models lack."""
    from anyspeed.convert import ConvertError

    unsupported = [
        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size != 1),
        ("--target-expert-parallel-size", args.target_expert_parallel_size != 1),
        ("--num-layer-list", args.num_layer_list is not None),
        ("--noop-layers", args.noop_layers is not None),
        ("--mtp-num-layers", args.mtp_num_layers is not None),
        ("--save-lora-to-hf", bool(args.save_lora_to_hf)),
        ("--lora-load", bool(args.lora_load) and not getattr(api, "MERGES_LORA", False)),
    ]
    for flag, given in unsupported:
        if given:
            raise ConvertError(
                f"{flag}: not supported for vision-language models (saved as "
                "torch_dist, which loads at any TP)"
            )
    if direction == ("hf", "mg"):
        api.hf_to_megatron(
            args.load_dir,
            args.save_dir,
            tp=args.target_tensor_parallel_size,
            ckpt_format=args.ckpt_format,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            params_dtype=args.params_dtype,
        )
        return args.load_dir, args.save_dir
    lora = {"lora": _lora(args)} if args.lora_load else {}
    api.megatron_to_hf(
        args.load_dir, args.save_dir, args.hf_cfg_dir, max_shard_size=args.max_shard_size, **lora
    )
    return args.save_dir, args.load_dir


if __name__ == "__main__":
    sys.exit(main())
