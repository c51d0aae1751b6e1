"""What both directions of conversion share: the dtypes, the staged output directory renamed into
place only when everything is written, the HF directory's preset and the target layout's checks.
The directions: :mod:`.to_megatron` (``hf_to_megatron``) and :mod:`.to_hf` (``megatron_to_hf``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from anyspeed.checkpoint.megatron_lm_args import family_for
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.hf_io import (
    HFCheckpoint,
)
from anyspeed.layout import Layout, uneven_stages
from anyspeed.layout.placement import parse_noop_layers
from anyspeed.models.config import ModelConfig
from anyspeed.models.families import mapping_for
from anyspeed.models.hf import HF_ARCHITECTURES, preset_from_hf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def staged_output(save_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``save_dir``, renamed to it on success and removed on failure."""
    final = Path(save_dir)
    if final.exists():
        raise ConvertError(f"--save-dir {final} already exists (nothing was written)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_hf_dir(path: str | Path) -> bool:
    """Whether ``path`` is an HF model directory (``config.json`` + safetensors weights)."""
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def preset_of(config: dict, model_type_hf: str | None) -> ModelConfig:
    """The preset of an HF config; ConvertError when its family or a field is not supported, or
    ``--model-type-hf`` names another family."""
    try:
        preset = preset_from_hf(config)
    except (ValueError, KeyError) as exc:
        raise ConvertError(str(exc).strip("'")) from None
    if model_type_hf:
        if family_for(model_type_hf) != preset.family:
            raise ConvertError(
                f"--model-type-hf {model_type_hf} does not match config.json "
                f"({HF_ARCHITECTURES[preset.family]})"
            )
    return preset


def with_mtp(
    preset: ModelConfig, names: list[str] | set[str], want: int | None = None
) -> ModelConfig:
    """``preset`` with the multi-token prediction layers the checkpoint's tensor ``names``
    hold (DeepSeek-V3 keeps them as HF layers after the last; transformers' own models and
    checkpoints saved from them have none, whatever config.json says), or its first ``want``."""
    m = mapping_for(preset.family)
    have, n = set(names), 0
    while m.mtp and m.hf_layer.format(i=preset.num_layers + n) + "eh_proj.weight" in have:
        n += 1
    if want is not None and not 0 <= want <= n:
        raise ConvertError(
            f"--mtp-num-layers {want}: the checkpoint holds {n} multi-token prediction layers"
        )
    return dataclasses.replace(preset, mtp_num_layers=(n if want is None else want) or None)


def hf_dir_preset(hf_dir: str | Path, model_type_hf: str | None = None) -> ModelConfig:
    """The model an HF directory holds: its config.json and, for MTP, its tensors."""
    ck = HFCheckpoint(hf_dir)
    return with_mtp(preset_of(ck.config, model_type_hf), ck.names)


def check_target(
    preset: ModelConfig,
    tp: int,
    pp: int,
    num_layer_list: str | None = None,
    ep: int = 1,
    ckpt_format: str = "torch_dist",
    noop_layers: str | None = None,
) -> list[int]:
    """The layers of each pipeline stage; one-line error when Megatron cannot lay the model
    out at TP x PP (with ``num_layer_list``, MindSpeed-LLM's uneven stages; with
    ``noop_layers``, its empty slots among the model's layers plus these)."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ConvertError(
            "--target-tensor-parallel-size, --target-pipeline-parallel-size and "
            "--target-expert-parallel-size must be >= 1"
        )
    biased_experts = preset.is_moe and preset.add_bias_linear
    if biased_experts and tp > 1 and ckpt_format == "legacy":
        raise ConvertError(
            f"--ckpt-format legacy at --target-tensor-parallel-size {tp}: legacy rank files "
            "split experts over TP, and Megatron-Core 0.16.1 cannot split experts with biases "
            "(GPT-OSS); use --ckpt-format torch_dist (it loads at any layout)"
        )
    try:
        # torch_dist loads at any layout: a biased-expert model's TP is the run's to refuse
        # (sequence parallelism is the run's choice: a conversion is good for either)
        layout = Layout(
            tp=1 if biased_experts else tp,
            pp=pp,
            ep=ep,
            sequence_parallel=tp > 1 and not biased_experts,
            **uneven_stages(pp, None, None, num_layer_list),
            noop_layers=parse_noop_layers(noop_layers),
        )
        if num_layer_list and noop_layers:
            raise ValueError("--noop-layers and --num-layer-list both place layers: give one")
        if num_layer_list and sum(map(int, num_layer_list.split(","))) != preset.num_layers:
            raise ValueError(
                f"--num-layer-list {num_layer_list} does not add up to the "
                f"model's {preset.num_layers} layers"
            )
        layout.validate_for(tp * pp * ep, preset)
        check_tp_divisible(preset, tp)
        return layout.stage_layers(preset.num_layers)
    except ValueError as exc:
        msg = (
            str(exc)
            .replace("--tensor-model", "--target-tensor")
            .replace("--pipeline-model", "--target-pipeline")
            .replace("--expert-model-parallel-size", "--target-expert-parallel-size")
        )
        raise ConvertError(msg) from None


def check_tp_divisible(preset: ModelConfig, tp: int) -> None:
    """ValueError (one line) when Megatron cannot shard this model over ``tp`` ranks."""
    sizes = {"ffn hidden size": preset.ffn_hidden_size}
    if preset.is_moe:
        sizes["expert ffn hidden size"] = preset.expert_ffn_size
        sizes["shared expert size"] = preset.moe_shared_expert_intermediate_size or 0
    for what, size in sizes.items():
        if size % tp:
            raise ValueError(
                f"{what} {size} is not divisible by --target-tensor-parallel-size {tp}"
            )


def write_hf_dir(
    save_dir: str | Path,
    named: dict[str, Any],
    hf_config: dict[str, Any],
    side_dir: str | Path | None,
    max_shard_size: str | int,
) -> None:
    """An HF directory (atomically): tensors ``named``, ``side_dir``'s side files, config."""
    from anyspeed.convert.hf_io import ShardedWriter, copy_side_files

    with staged_output(save_dir) as tmp:
        writer = ShardedWriter(tmp, [(k, tuple(t.shape)) for k, t in named.items()], max_shard_size)
        writer.add(named)
        writer.close()
        if side_dir:
            copy_side_files(side_dir, tmp)
        dtype = str(next(iter(named.values())).dtype).removeprefix("torch.")
        config = dict(hf_config, dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
