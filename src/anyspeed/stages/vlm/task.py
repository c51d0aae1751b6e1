"""The ``vlm`` stage: a LLaVA model (language model, CLIP/SigLIP tower, projector) trained on
image-text conversations, with MindSpeed-MM's / Megatron-LM's freeze switches. A Qwen2-VL /
Qwen2.5-VL start or checkpoint goes to :mod:`anyspeed.stages.vlm.qwen`.

``--load <HF LLaVA dir>`` starts from transformers' ``LlavaForConditionalGeneration`` weights
(converted in memory, each rank its TP shard); ``--load <checkpoint>`` resumes a ``vlm`` run. The
loss is the global token mean over the assistant's tokens (image and prompt tokens carry none),
the same at every TP/DP layout. The data: :mod:`anyspeed.stages.vlm.data`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.errors import UsageError
from anyspeed.models.vision import RECORD
from anyspeed.stages.common.losses import per_token_loss
from anyspeed.training.task import LossFunc, StagePlan, Task

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


@dataclass(frozen=True)
class VLMConfig:
    llava: Any  # anyspeed.models.vision.LlavaConfig (its language model: the run's)
    hf_dir: str | None
    text_len: int  # text tokens per row: with the image's embeddings, --seq-length
    freeze_vit: bool = False
    freeze_lm: bool = False
    freeze_projector: bool = False


def _llava_config(args: argparse.Namespace) -> Any:
    from anyspeed.convert.hf_io import read_config
    from anyspeed.models.vision import from_record, llava_from_hf

    if args.vlm_hf_dir:
        return llava_from_hf(read_config(args.vlm_hf_dir))
    from anyspeed.checkpoint.reads import read_common, tracked_dir

    path = tracked_dir(args.load) if args.load else None
    saved = read_common(path).get(RECORD) if path else None
    if not saved:
        raise UsageError(
            "--stage vlm starts from a Hugging Face LLaVA directory (--load "
            "DIR with config.json and safetensors) or resumes a vlm "
            "checkpoint"
        )
    return from_record(saved, None)


def plan_llava(args: argparse.Namespace) -> StagePlan:
    """The vlm checks: the model, the layout, the tokenizer and the data (bad records counted)."""
    from anyspeed.layout import Layout
    from anyspeed.models.multimodal import check_layout
    from anyspeed.stages.vlm import data as vlm_data

    if args.lora_target_modules or args.lora_r or args.lora_load:
        raise UsageError(
            "--lora-*: LoRA is not supported for a LLaVA model in --stage vlm (it is for "
            "Qwen-VL); train in full or freeze parts (--freeze-LM, --freeze-ViT, "
            "--freeze-projector)"
        )
    cfg = _llava_config(args)
    try:
        check_layout(cfg, Layout.from_args(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    text_len = args.seq_length - (cfg.image_seq_len - 1)
    if text_len < 2:
        raise UsageError(
            f"--seq-length {args.seq_length}: an image alone takes "
            f"{cfg.image_seq_len} positions; raise it"
        )
    if args.mock_data or not args.data_path or len(args.data_path) != 1:
        raise UsageError("--data-path: give exactly one LLaVA conversation .jsonl file")
    path = args.data_path[0]
    if not os.path.isfile(path):
        raise UsageError(f"--data-path {path!r}: no such file")
    data = vlm_data.read(
        path,
        args.image_folder or os.path.dirname(path),
        tokenizer_of(args),
        cfg.image_token_id,
        text_len,
        args.max_image_pixels,
    )
    report(path, data)
    vcfg = VLMConfig(
        cfg, args.vlm_hf_dir, text_len, args.freeze_vit, args.freeze_lm, args.freeze_projector
    )
    from anyspeed.convert.hf_io import read_config
    from anyspeed.models.vision import record

    hf_config = read_config(args.vlm_hf_dir) if args.vlm_hf_dir else _recorded_hf_config(args)
    return StagePlan(None, vcfg, data, {RECORD: record(cfg, hf_config)})


def _recorded_hf_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The HF config.json the resumed checkpoint recorded (carried into this run's)."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir

    path = tracked_dir(args.load) if args.load else None
    common = read_common(path) if path else {}
    saved = json.loads(common.get(RECORD, "{}")).get("hf_config")
    converted = common.get("anyspeed_convert", {}).get("hf_config_json")
    return saved or (json.loads(converted) if converted else None)


def tokenizer_of(args: argparse.Namespace) -> Any:
    if args.tokenizer_type not in ("PretrainedFromHF", "HuggingFaceTokenizer"):
        raise UsageError(
            "--stage vlm tokenizes its records: pass --tokenizer-type "
            "PretrainedFromHF --tokenizer-name-or-path DIR"
        )
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer

    return load_tokenizer(TokenizerSpec(name_or_path=args.tokenizer_name_or_path))


def report(path: str, data: Any) -> None:
    from anyspeed.launch import reports_here

    if not data.samples:
        first = next(iter(data.skipped.values()), ["(empty file)"])[0]
        raise UsageError(f"--data-path {path!r}: no record can train (first: {first})")
    if data.skipped and reports_here():
        for kind, where in data.skipped.items():
            print(
                f"anyspeed posttrain: warning: skipped {len(where)} records of {path!r} "
                f"({kind}; first: {where[0]})",
                file=sys.stderr,
            )


class VLMTask(Task):
    """Caption / conversation loss of a LLaVA model on images and text."""

    name = "vlm"

    def __init__(self, cfg: VLMConfig) -> None:
        self.cfg = cfg

    def build(self, model: Any, config: Any, layout: Any) -> list[torch.nn.Module]:
        from anyspeed.models.multimodal import freeze, stage_chunk

        llava = dataclasses.replace(self.cfg.llava, language=model)
        seq = self.cfg.text_len - 1 + llava.image_seq_len
        chunk = stage_chunk(llava, config, layout, max_sequence_length=seq)
        c = self.cfg
        freeze(chunk, vision=c.freeze_vit, language=c.freeze_lm, projector=c.freeze_projector)
        return [chunk]

    def transforms(self) -> list[Any]:
        return [per_token_loss]

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        """An HF start: every rank reads the HF tensors and copies in its TP shard."""
        if not self.cfg.hf_dir:
            return False
        chunk = trainer.model[0].module
        self.load_hf(getattr(chunk, "module", chunk), run)  # under a Float16Module or not
        if hasattr(trainer.optimizer, "reload_model_params"):
            trainer.optimizer.reload_model_params()
        return True

    def load_hf(self, inner: torch.nn.Module, run: Run) -> None:
        """Copy this rank's shard of the HF directory's weights into the bare model."""
        from megatron.core import parallel_state as ps

        from anyspeed.convert import llava as conv
        from anyspeed.convert.hf_io import HFCheckpoint

        ck = HFCheckpoint(self.cfg.hf_dir)
        layout = conv.layout_of(ck.names)
        dtype = next(inner.parameters()).dtype
        llava = dataclasses.replace(self.cfg.llava, language=run.model)
        state_ = conv.to_megatron(
            llava, lambda n: ck.get(conv.hf_name(n, layout)).to(dtype), run.model.vocab_size
        )
        conv.load_into(inner, state_, run.layout.tp, ps.get_tensor_model_parallel_rank())

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        from anyspeed.stages.common.losses import token_loss

        losses, mask = self.losses(model, next(data_iterator))

        def loss_func(output: torch.Tensor):
            total, count, report = token_loss(output, mask)
            return total, count, {self.loss_key: report}

        return losses, loss_func

    def losses(
        self, model: torch.nn.Module, b: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token losses, loss mask) of micro-batch ``b``."""
        return model(
            b["images"], b["tokens"], None, None, labels=b["labels"], loss_mask=b["loss_mask"]
        )

    def datasets(self, run: Run) -> list[Any]:
        from anyspeed.stages.common.instruction_data import split_datasets

        return split_datasets(run.data, run.args.split)

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        from anyspeed.stages.common.instruction_data import global_batches
        from anyspeed.stages.vlm.data import micro_batch

        data, rows = dataset
        v = self.cfg.llava.vision

        def make(idx: list[int]) -> dict[str, torch.Tensor]:
            return micro_batch(data, idx, self.cfg.text_len, v.image_size, v.kind)

        return global_batches(run.args, rows, consumed, device, make)
