"""A loaded model to run inference on: checkpoint (any saved layout) or HF directory -> chunks.

Shared by ``anyspeed generate`` and ``anyspeed evaluate``: the architecture comes from the
checkpoint's model record (:mod:`anyspeed.checkpoint.record`), which also says whether it is a
GPT or a LLaVA model (``anyspeed_llava``); an HF directory is converted once (cached) as
``anyspeed pretrain --load`` does; the weights load at the layout asked for, whatever layout
saved them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.commands import lora_load
from anyspeed.errors import UsageError
from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--load``, the tokenizer, the layout and the optional architecture flags to check."""
    g = p.add_argument_group("model")
    g.add_argument("--load", required=True, help="Megatron checkpoint or Hugging Face directory")
    g.add_argument(
        "--tokenizer-name-or-path",
        default=None,
        help="HF tokenizer directory (default: --load when it holds one)",
    )
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--nproc-per-node", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--max-length",
        "--seq-length",
        dest="max_length",
        type=int,
        default=None,
        help="context window in tokens (default: max positions)",
    )
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument(
        "--tokenizer-not-use-fast",
        action="store_true",
        help="accepted: the tokenizer is read from its tokenizer.json (the fast form)",
    )
    lora_load.add_arguments(p)
    # The architecture and training flags of MindSpeed-LLM's inference scripts are parsed
    # apart and checked against the checkpoint (commands.training_flags).


@dataclass(frozen=True)
class InferenceRun:
    """One checked inference command line: the flags (completed at parse time, then frozen),
    the model (``ModelConfig``, or ``LlavaConfig`` for a vision-language model), the layout,
    the checkpoint the weights load from (an HF ``--load``'s cached conversion), the tokenizer
    and what the command's check opened (``evaluate``: the task's items)."""

    prog: str
    args: argparse.Namespace
    model: Any
    layout: Layout
    load: str
    hf_dir: str | None
    tokenizer: Any
    data: Any = None

    @property
    def llava(self) -> bool:
        """Whether the model is a LLaVA vision-language model."""
        return is_llava(self.model)


def model_of(ckpt: str) -> Any:
    """The architecture the checkpoint under ``ckpt`` records: a ``ModelConfig``, or the
    ``LlavaConfig`` of a LLaVA checkpoint (UsageError naming ``--load``)."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common
    from anyspeed.models.qwen_vl import spec as qwen
    from anyspeed.models.vision import RECORD, from_record

    try:
        path = tracked_dir(ckpt)
        common = read_common(path) if path else {}
        model = model_in_common(common, ckpt, as_hf=False) if path else None
        if model is not None and RECORD in common:
            return from_record(common[RECORD], model)
        if model is not None and qwen.RECORD in common:
            return qwen.from_record(common[qwen.RECORD], model)
    except (UsageError, ValueError) as exc:  # a broken file or model record
        raise UsageError(f"--load {ckpt!r}: {exc}") from None
    if path is None:
        raise UsageError(f"--load {ckpt!r}: not a checkpoint or Hugging Face directory")
    if model is None:
        raise UsageError(f"--load {ckpt!r}: the checkpoint does not describe its architecture")
    return model


def is_llava(model: Any) -> bool:
    """Whether ``model`` (what :func:`model_of` returns) is a vision-language model (LLaVA or
    Qwen-VL)."""
    return not isinstance(model, ModelConfig)


def is_qwen_vl(model: Any) -> bool:
    """Whether ``model`` is a Qwen2-VL / Qwen2.5-VL model."""
    from anyspeed.models.qwen_vl.spec import QwenVLSpec

    return isinstance(model, QwenVLSpec)


def language(model: Any) -> ModelConfig:
    """The language model of ``model`` (itself for a GPT)."""
    return model if isinstance(model, ModelConfig) else model.language


def check_flags(args: argparse.Namespace, model: Any) -> None:
    """UsageError when an architecture flag given disagrees with the checkpoint."""
    from anyspeed.commands import training_flags

    training_flags.check(args, language(model))


def complete(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The architecture ``--load`` holds (an HF directory's from its config.json, padded as
    its conversion will be) and the HF directory (None for a checkpoint), checked against the
    flags; cheap, before any process group. Parse time: fills in the defaults that come from
    the model (``--tokenizer-name-or-path``, ``--max-length``) before the flags are frozen."""
    import os

    from anyspeed.convert.hf_cache import hf_dir_of

    if not os.path.isdir(args.load):
        raise UsageError(f"--load {args.load!r}: no such directory")
    hf_dir = hf_dir_of(["--load", args.load])
    if hf_dir:
        if args.tokenizer_name_or_path is None and _has_tokenizer(hf_dir):
            args.tokenizer_name_or_path = hf_dir
        model = _hf_model(args, hf_dir)
    else:
        model = model_of(args.load)
        if args.tokenizer_name_or_path is None and _has_tokenizer(args.load):
            args.tokenizer_name_or_path = args.load  # a converted LLaVA keeps its tokenizer
        recorded = getattr(model, "tokenizer", None)  # a Qwen-VL run's, where it still is
        if args.tokenizer_name_or_path is None and recorded and _has_tokenizer(recorded):
            args.tokenizer_name_or_path = recorded
    check_flags(args, model)
    lora_load.check(args, model)
    _check_layout(args, language(model))
    if args.max_length is None:
        args.max_length = language(model).max_position_embeddings
    return model, hf_dir


def _hf_model(args: argparse.Namespace, hf_dir: str) -> Any:
    import dataclasses

    from anyspeed.convert.hf_io import read_config
    from anyspeed.convert.llava_api import is_llava_config
    from anyspeed.models.config import padded_vocab_size
    from anyspeed.models.vision import llava_from_hf

    try:
        config = read_config(hf_dir)
        model = (
            llava_from_hf(config) if is_llava_config(config) else _qwen_vl_or_gpt(hf_dir, config)
        )
    except ValueError as exc:
        raise UsageError(f"--load {hf_dir!r}: {exc}") from None
    vocab = padded_vocab_size(
        language(model).vocab_size,
        args.make_vocab_size_divisible_by,
        args.tensor_model_parallel_size,
    )
    if isinstance(model, ModelConfig):
        return dataclasses.replace(model, vocab_size=vocab)
    return model.with_language(vocab_size=vocab)


def _qwen_vl_or_gpt(hf_dir: str, config: dict) -> Any:
    """A Qwen-VL HF directory's spec (its processor settings and tokenizer), else its GPT."""
    from anyspeed.models.hf import preset_from_hf
    from anyspeed.models.qwen_vl.spec import QwenVLSpec, is_qwen_vl

    if not is_qwen_vl(config):
        return preset_from_hf(config)
    from anyspeed.convert.qwen_vl import language_preset
    from anyspeed.data.qwen_vl_pixels import processor_settings

    vc = config["vision_config"]
    settings = processor_settings(
        hf_dir,
        int(vc["patch_size"]),
        int(vc.get("spatial_merge_size", 2)),
        int(vc.get("temporal_patch_size", 2)),
    )
    return QwenVLSpec(config, language_preset(config), settings, hf_dir)


def _check_layout(args: argparse.Namespace, model: ModelConfig) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise UsageError(
            "--tensor-model-parallel-size and --pipeline-model-parallel-size must be positive"
        )
    if model.vocab_size % tp or model.num_attention_heads % tp:
        raise UsageError(
            f"--tensor-model-parallel-size {tp} does not divide the checkpoint's "
            f"vocabulary ({model.vocab_size}) and heads "
            f"({model.num_attention_heads})"
        )
    if model.num_layers % pp:
        raise UsageError(
            f"--pipeline-model-parallel-size {pp} does not divide the {model.num_layers} layers"
        )


def materialize(args: argparse.Namespace, hf_dir: str, prog: str = "anyspeed generate") -> str:
    """Convert HF directory ``hf_dir`` (once, cached); the checkpoint it is converted to."""
    from anyspeed.convert.hf_cache import convert

    conv = argparse.Namespace(
        padded_vocab_size=None,
        save=None,
        bf16=args.bf16,
        fp16=args.fp16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    return convert(conv, hf_dir, prog)


def _has_tokenizer(d: str) -> bool:
    import os

    return any(os.path.isfile(os.path.join(d, f)) for f in ("tokenizer.json", "tokenizer.model"))


def load_model(
    ckpt: str,
    model: Any,
    layout: Layout,
    bf16: bool = False,
    fp16: bool = False,
    lora: str | None = None,
) -> list[torch.nn.Module]:
    """This rank's chunks with the checkpoint's weights, in eval mode (parallel state set): a
    GPT's pipeline chunks, or the one chunk of a LLaVA model (``model`` a ``LlavaConfig``);
    ``lora``: a LoRA checkpoint whose adapters are folded into the weights."""
    from anyspeed.checkpoint.errors import CheckpointMismatch
    from anyspeed.checkpoint.load import load_weights
    from anyspeed.device import torch_device
    from anyspeed.models import gpt, multimodal

    if isinstance(model, ModelConfig):
        config = gpt.transformer_config(model, layout, bf16=bf16, fp16=fp16)
        built = gpt.build_chunks(model, config, layout)
    elif is_qwen_vl(model):
        built = [_qwen_vl_model(model, layout, bf16, fp16)]
    else:  # weights come from the checkpoint: no initialisation to draw
        config = gpt.transformer_config(
            model.language, layout, bf16=bf16, fp16=fp16, perform_initialization=False
        )
        built = [multimodal.build_llava(model, config, layout)]
    chunks = [c.to(torch_device()).eval() for c in built]
    try:
        load_weights(ckpt, chunks)
    except CheckpointMismatch as exc:
        raise UsageError(str(exc)) from None
    if lora:
        lora_load.apply(chunks, lora)
    if torch_device().type == "cpu" and _fast_path():
        from anyspeed.features.inference.weights import prepare_for_decode

        prepare_for_decode(chunks)
    return chunks


def _fast_path() -> bool:
    """Whether the adaptor applied ``no-grad-fast-path`` in this process."""
    from anyspeed import adaptor

    st = adaptor.state()
    return st is not None and any(f.name == "no-grad-fast-path" for f in st.applied)


def _qwen_vl_model(spec: Any, layout: Layout, bf16: bool, fp16: bool) -> torch.nn.Module:
    """This rank's QwenVLModel (TP and pipeline stage of ``layout``; weights from the
    checkpoint)."""
    from megatron.core import parallel_state as ps

    from anyspeed.models import gpt
    from anyspeed.models.qwen_vl.model import QwenVLModel
    from anyspeed.models.qwen_vl.tower import tower_transformer_config

    kw: dict[str, Any] = {"perform_initialization": False}
    config = gpt.transformer_config(spec.language, layout, bf16=bf16, fp16=fp16, **kw)
    tower = tower_transformer_config(spec.tower, layout, config.params_dtype, **kw)
    return QwenVLModel(
        spec.tower,
        tower,
        spec.language,
        config,
        spec.tokens,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
