"""The ``vlm`` stage for Qwen2-VL / Qwen2.5-VL: the tower, the merger and a GPT with mRoPE
(:class:`anyspeed.models.qwen_vl.model.QwenVLModel`) trained on ``mllm`` conversations
(:mod:`anyspeed.stages.vlm.qwen_data`).

``--load <HF Qwen-VL dir>`` starts from ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` weights (either weight-name prefix), each rank copying in
its TP shard; ``--load <checkpoint>`` resumes a Qwen-VL ``vlm`` run. The loss is the global
token mean over the assistant's tokens, the same at every layout.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.errors import UsageError
from anyspeed.models.qwen_vl.spec import RECORD, is_qwen_vl, record
from anyspeed.stages.vlm.task import VLMTask
from anyspeed.training.task import StagePlan

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


def hf_flags(config: dict[str, Any], load: str, argv: list[str]) -> list[str]:
    """The language model's flags (mRoPE included) of an HF Qwen-VL directory."""
    from anyspeed.argv import get_flag
    from anyspeed.convert.errors import ConvertError
    from anyspeed.convert.qwen_vl import language_preset
    from anyspeed.models.config import padded_vocab_size

    try:
        preset = language_preset(config)
    except (ConvertError, KeyError, ValueError) as exc:
        raise UsageError(f"--load {load!r}: {exc}") from None
    tp = int(get_flag(argv, "--tensor-model-parallel-size", "1") or 1)
    divisible = int(get_flag(argv, "--make-vocab-size-divisible-by", "128") or 128)
    padded = padded_vocab_size(preset.vocab_size, divisible, tp)
    flags = [*preset.megatron_args(), "--vlm-hf-dir", load, "--padded-vocab-size", str(padded)]
    if os.path.isfile(os.path.join(load, "tokenizer.json")):
        flags += ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", load]
    return flags


@dataclass(frozen=True)
class QwenVLConfig:
    hf_config: dict[str, Any]  # the HF config.json (the tower and the special tokens)
    processor: dict[str, Any]  # the image processor's settings
    hf_dir: str | None
    freeze_vit: bool = False
    freeze_lm: bool = False
    freeze_projector: bool = False
    lora: Any = None  # anyspeed.training.lora.LoRAConfig: adapters on the language model

    @property
    def tower(self) -> Any:
        from anyspeed.models.qwen_vl.config import tower_from_hf

        return tower_from_hf(self.hf_config["vision_config"])

    @property
    def tokens(self) -> Any:
        from anyspeed.models.qwen_vl.spec import tokens_from_hf

        return tokens_from_hf(self.hf_config)

    def vision(self) -> Any:
        from anyspeed.stages.vlm.qwen_data import Vision

        return Vision.of(self.hf_config, self.processor)


def _saved(args: argparse.Namespace) -> dict[str, Any] | None:
    from anyspeed.checkpoint.reads import read_common, tracked_dir

    path = tracked_dir(args.load) if args.load else None
    text = read_common(path).get(RECORD) if path else None
    return json.loads(text) if text else None


def tokenizer_flags(common: dict[str, Any]) -> list[str]:
    """The tokenizer a Qwen-VL checkpoint's run used, where it still is (explicit flags win)."""
    path = json.loads(common.get(RECORD) or "{}").get("tokenizer")
    if not path or not os.path.isdir(path):
        return []
    return ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", path]


def config_of(args: argparse.Namespace) -> QwenVLConfig | None:
    """The run's Qwen-VL config (from the HF directory or the resumed checkpoint); None for
    another model."""
    from anyspeed.convert.hf_io import read_config
    from anyspeed.data.qwen_vl_pixels import processor_settings

    saved = None if args.vlm_hf_dir else _saved(args)
    hf_config = read_config(args.vlm_hf_dir) if args.vlm_hf_dir else (saved or {}).get("hf_config")
    if not hf_config or not is_qwen_vl(hf_config):
        return None
    vc = hf_config["vision_config"]
    settings = (saved or {}).get("processor") or processor_settings(
        args.vlm_hf_dir,
        int(vc["patch_size"]),
        int(vc.get("spatial_merge_size", 2)),
        int(vc.get("temporal_patch_size", 2)),
    )
    for key in ("min_pixels", "max_pixels"):
        if getattr(args, f"image_{key}", None):
            settings = {**settings, key: int(getattr(args, f"image_{key}"))}
    if settings["min_pixels"] > settings["max_pixels"]:
        raise UsageError(
            f"--image-min-pixels {settings['min_pixels']} is above --image-max-pixels "
            f"{settings['max_pixels']}: no size fits both"
        )
    from anyspeed.training import lora

    return QwenVLConfig(
        hf_config,
        settings,
        args.vlm_hf_dir,
        args.freeze_vit,
        args.freeze_lm,
        args.freeze_projector,
        lora.from_args(args),
    )


def check_layout(args: argparse.Namespace, cfg: QwenVLConfig) -> None:
    """One line naming the flag for a layout the Qwen-VL path does not run yet."""
    from anyspeed.layout import Layout

    layout = Layout.from_args(args)
    for flag, bad in (
        ("--num-layers-per-virtual-pipeline-stage", bool(layout.vpp)),
        ("--expert-model-parallel-size", layout.ep > 1),
    ):
        if bad:
            raise UsageError(
                f"{flag}: not supported for Qwen-VL in --stage vlm yet; use TP (with "
                "--sequence-parallel), PP, CP and DP"
            )
    from anyspeed.models.multimodal import check_tower_tp

    try:
        check_tower_tp(cfg.tower.num_heads, cfg.tower.ffn_hidden_size, layout.tp)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def plan(args: argparse.Namespace, cfg: QwenVLConfig, tok: Any) -> StagePlan:
    """The Qwen-VL checks and its data (bad records counted)."""
    from anyspeed.stages.vlm import qwen_data
    from anyspeed.stages.vlm.task import report

    check_layout(args, cfg)
    if args.mock_data or not args.data_path or len(args.data_path) != 1:
        raise UsageError("--data-path: give exactly one mllm conversation .json/.jsonl file")
    path = args.data_path[0]
    if not os.path.isfile(path):
        raise UsageError(f"--data-path {path!r}: no such file")
    folder = args.image_folder or os.path.dirname(path)
    data = qwen_data.read(path, folder, tok, cfg.vision(), args.seq_length, args.max_image_pixels)
    report(path, data)
    tokenizer = os.path.abspath(args.tokenizer_name_or_path)
    records = {RECORD: record(cfg.hf_config, cfg.processor, tokenizer)}
    if cfg.lora is not None:
        records.update(cfg.lora.record().to_common())
    return StagePlan(None, cfg, data, records)


class QwenVLTask(VLMTask):
    """The conversation loss of a Qwen2-VL / Qwen2.5-VL model on images, videos and text (the
    LLaVA task's data split and per-token loss; its own model, start and batches)."""

    cfg: QwenVLConfig  # type: ignore[assignment]

    def __init__(self, cfg: QwenVLConfig) -> None:
        self.cfg = cfg
        self._pixels: Any = None

    def build(self, model: Any, config: Any, layout: Any) -> list[torch.nn.Module]:
        from megatron.core import parallel_state as ps

        from anyspeed.models.qwen_vl.model import QwenVLModel
        from anyspeed.models.qwen_vl.tower import tower_transformer_config

        tower = self.cfg.tower
        init = {"perform_initialization": config.perform_initialization}
        tower_config = tower_transformer_config(tower, layout, config.params_dtype, **init)
        chunk = QwenVLModel(
            tower,
            tower_config,
            model,
            config,
            self.cfg.tokens,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
        freeze(chunk, self.cfg)
        return [chunk]

    def transforms(self) -> list[Any]:
        lora = [self.cfg.lora.transform()] if self.cfg.lora else []
        return [*super().transforms(), *lora]

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        """The HF start (then LoRA's adapters, from --lora-load or fresh), or LoRA's start
        from a checkpoint; False: the engine's resume."""
        from anyspeed.stages.common.lora_start import lora_start

        if not self.cfg.hf_dir:
            return lora_start(self.cfg.lora, run, trainer, scheduler, state)
        super().load(run, trainer, scheduler, state)
        if self.cfg.lora is not None:
            from anyspeed.training.engine import resume
            from anyspeed.training.lora import set_view

            set_view(trainer.model, "adapters")  # checkpoints hold the adapters
            if self.cfg.lora.load:
                resume(run, trainer, scheduler, state, root=self.cfg.lora.load, flag="--lora-load")
        return True

    def load_hf(self, inner: torch.nn.Module, run: Run) -> None:
        load_hf(inner, self.cfg, run.model.vocab_size, run.layout.tp)

    def losses(
        self, model: torch.nn.Module, b: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from anyspeed.models.qwen_vl.model import cp_share

        mask = cp_share(b.pop("loss_mask"), seq_dim=1)  # the model shares the rest itself
        return model(b.pop("tokens"), labels=b.pop("labels"), **b), mask

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        from megatron.core import parallel_state as ps

        from anyspeed.data.qwen_vl_pixels import Pixels
        from anyspeed.stages.common.instruction_data import global_batches
        from anyspeed.stages.vlm.qwen_data import micro_batch

        if self._pixels is None:
            self._pixels = Pixels(self.cfg.processor)
        data, rows = dataset
        seconds = self.cfg.tower.kind == "qwen2_5_vl"
        pixels = self._pixels if ps.is_pipeline_first_stage() else None  # later: grids only

        def make(idx: list[int]) -> dict[str, torch.Tensor]:
            return micro_batch(data, idx, run.args.seq_length, pixels, seconds)

        return global_batches(run.args, rows, consumed, device, make, cp_split=False)


def freeze(chunk: torch.nn.Module, cfg: QwenVLConfig) -> None:
    """MindSpeed-MM's freeze switches: the tower (patch embedding and layers), the merger,
    the language model."""
    parts = {
        "vision.patch_embed": cfg.freeze_vit,
        "vision.decoder": cfg.freeze_vit,
        "vision.merger": cfg.freeze_projector,
        "language_model": cfg.freeze_lm,
    }
    for name, p in chunk.named_parameters():
        if any(name.startswith(k) and off for k, off in parts.items()):
            p.requires_grad_(False)


def load_hf(model: torch.nn.Module, cfg: QwenVLConfig, vocab: int, tp: int) -> None:
    """Copy this rank's shard (TP and pipeline stage) of the HF weights into ``model``."""
    import functools

    from megatron.core import parallel_state as ps

    from anyspeed.convert.hf_io import HFCheckpoint
    from anyspeed.convert.llava import load_into
    from anyspeed.convert.qwen_vl import current_name, model_to_megatron, shard

    assert cfg.hf_dir is not None
    ck = HFCheckpoint(cfg.hf_dir)
    names = {current_name(n): n for n in ck.names}
    dtype = next(model.parameters()).dtype
    _, _, state = model_to_megatron(cfg.hf_config, lambda n: ck.get(names[n]).to(dtype), vocab)
    split = functools.partial(shard, gated=cfg.tower.kind == "qwen2_5_vl")
    try:
        load_into(model, state, tp, ps.get_tensor_model_parallel_rank(), split)
    except (KeyError, ValueError) as exc:
        raise UsageError(
            f"--load {cfg.hf_dir!r}: the weights do not fit the model ({exc})"
        ) from None
