"""The ``vlm`` stage's row: its flags, its command-line expansion of ``--load``, and the
dispatch to the model family's plan and task (LLaVA: :mod:`.task`; Qwen2-VL / Qwen2.5-VL:
:mod:`.qwen`)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from anyspeed.errors import UsageError
from anyspeed.models.vision import RECORD
from anyspeed.stages.vlm.data import MAX_IMAGE_PIXELS
from anyspeed.training.task import StagePlan, Task

if TYPE_CHECKING:
    from anyspeed.training.run import Run


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The vision-language flags (Megatron-LM's multimodal names where they exist)."""
    g = p.add_argument_group("vision-language")
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        help="images with more pixels are skipped (counted) before decoding (default 4096^2)",
    )
    g.add_argument(
        "--image-folder",
        default=None,
        help="directory the records' image paths are relative to (default: the jsonl's directory)",
    )
    g.add_argument(
        "--freeze-ViT",
        "--freeze-vit",
        dest="freeze_vit",
        action="store_true",
        help="no training of the vision tower",
    )
    g.add_argument(
        "--freeze-LM",
        "--freeze-lm",
        dest="freeze_lm",
        action="store_true",
        help="no training of the language model",
    )
    g.add_argument(
        "--freeze-projector",
        "--freeze-projection",
        dest="freeze_projector",
        action="store_true",
        help="no training of the projector (Qwen-VL: the merger)",
    )
    g.add_argument(
        "--image-min-pixels",
        type=int,
        default=None,
        help="Qwen-VL: images are resized to at least this many pixels (default: the "
        "processor's, 56^2)",
    )
    g.add_argument(
        "--image-max-pixels",
        type=int,
        default=None,
        help="Qwen-VL: images are resized to at most this many pixels (default: the "
        "processor's, 28^2 * 1280)",
    )
    g.add_argument("--vlm-hf-dir", default=None, help=argparse.SUPPRESS)


def expand_argv(argv: list[str]) -> list[str]:
    """``--load <HF LLaVA dir>``: the language model's architecture and the directory's
    tokenizer as flags (explicit flags win); the weights are read by the task."""
    from anyspeed.argv import get_flag, merge_flags, pop_flag
    from anyspeed.convert import is_hf_dir
    from anyspeed.convert.hf_io import read_config
    from anyspeed.models.config import padded_vocab_size
    from anyspeed.models.vision import llava_from_hf

    load = get_flag(argv, "--load")
    if load and not is_hf_dir(load):
        return merge_flags(_checkpoint_flags(load), argv)
    if not load:
        return argv
    from anyspeed.stages.vlm import qwen

    try:
        config = read_config(load)
        if qwen.is_qwen_vl(config):
            _, argv = pop_flag(argv, "--load")
            return merge_flags(qwen.hf_flags(config, load, argv), argv)
        cfg = llava_from_hf(config)
    except ValueError as exc:  # ConvertError (a bad file) is one too
        raise UsageError(f"--load {load!r}: {exc}") from None
    _, argv = pop_flag(argv, "--load")
    tp = int(get_flag(argv, "--tensor-model-parallel-size", "1") or 1)
    divisible = int(get_flag(argv, "--make-vocab-size-divisible-by", "128") or 128)
    flags = [
        *cfg.language.megatron_args(),
        "--vlm-hf-dir",
        load,
        "--padded-vocab-size",
        str(padded_vocab_size(cfg.language.vocab_size, divisible, tp)),
    ]
    if os.path.isfile(os.path.join(load, "tokenizer.json")):
        flags += ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", load]
    return merge_flags(flags, argv)


def _checkpoint_flags(load: str) -> list[str]:
    """A vlm checkpoint's language-model flags (its model record; a Qwen-VL one's tokenizer
    too); none for another."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common

    try:
        path = tracked_dir(load)
        common = read_common(path) if path else {}
    except Exception:  # noqa: BLE001 - the generic --load checks report an unreadable one
        return []
    from anyspeed.stages.vlm import qwen

    ours = RECORD in common or qwen.RECORD in common
    model = model_in_common(common, load, as_hf=False) if ours else None
    return [*model.megatron_args(), *qwen.tokenizer_flags(common)] if model else []


def plan(args: argparse.Namespace) -> StagePlan:
    """The checks and data of the run's family (a Qwen-VL start or checkpoint, else LLaVA)."""
    from anyspeed.stages.vlm import qwen, task

    qwen_cfg = qwen.config_of(args)
    if qwen_cfg is not None:
        return qwen.plan(args, qwen_cfg, task.tokenizer_of(args))
    return task.plan_llava(args)


def make_task(run: Run) -> Task:
    from anyspeed.stages.vlm.qwen import QwenVLConfig, QwenVLTask
    from anyspeed.stages.vlm.task import VLMTask

    if isinstance(run.config, QwenVLConfig):
        return QwenVLTask(run.config)
    return VLMTask(run.config)
