"""``anyspeed convert`` of a LLaVA model (``LlavaForConditionalGeneration`` <-> ``LLaVAModel``):
recognised from the input, with the flags that apply to it checked first."""

from __future__ import annotations

import argparse
from pathlib import Path


def is_llava_input(args: argparse.Namespace) -> bool:
    """Whether ``--load-dir`` holds a LLaVA model (an HF directory or a Megatron checkpoint)."""
    from anyspeed.convert.llava_api import is_llava_checkpoint, is_llava_config

    load = Path(args.load_dir)
    if args.load_model_type == "hf":
        if not (load / "config.json").is_file():
            return False
        from anyspeed.convert.hf_io import read_config

        return is_llava_config(read_config(load))
    from anyspeed.checkpoint.reads import checkpoint_dir, read_common

    try:
        return is_llava_checkpoint(read_common(checkpoint_dir(load)))
    except Exception:  # noqa: BLE001 - not readable here: the GPT path reports it
        return False


def run(args: argparse.Namespace, direction: tuple[str, str]) -> tuple[str | None, str]:
    """Convert; (HF dir, Megatron dir) for ``--verify``. ConvertError for a flag LLaVA lacks."""
    from anyspeed.convert import ConvertError
    from anyspeed.convert import llava_api as api

    unsupported = [
        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size != 1),
        ("--target-expert-parallel-size", args.target_expert_parallel_size != 1),
        ("--num-layer-list", args.num_layer_list is not None),
        ("--mtp-num-layers", args.mtp_num_layers is not None),
        ("--lora-load", bool(args.lora_load or args.save_lora_to_hf)),
    ]
    for flag, given in unsupported:
        if given:
            raise ConvertError(f"{flag}: not supported for LLaVA models (saved as torch_dist, "
                               "which loads at any TP and PP)")  # fmt: skip
    if direction == ("hf", "mg"):
        api.hf_to_megatron(args.load_dir, args.save_dir, tp=args.target_tensor_parallel_size,
                           ckpt_format=args.ckpt_format,
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                           params_dtype=args.params_dtype)  # fmt: skip
        return args.load_dir, args.save_dir
    api.megatron_to_hf(args.load_dir, args.save_dir, args.hf_cfg_dir,
                       max_shard_size=args.max_shard_size)  # fmt: skip
    return args.save_dir, args.load_dir
