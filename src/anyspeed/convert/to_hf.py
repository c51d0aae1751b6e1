"""``megatron_to_hf``: a Megatron checkpoint (torch_dist or legacy, any layout) to an HF directory,
one group at a time into a staged directory renamed into place at the end."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from anyspeed.checkpoint.reads import checkpoint_dir, checkpoint_format, read_common
from anyspeed.checkpoint.record import MODEL_KEY, model_in_common
from anyspeed.convert import engine
from anyspeed.convert.api import preset_of, staged_output
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.hf_io import (
    ShardedWriter,
    copy_side_files,
    read_config,
)
from anyspeed.convert.megatron_io import (
    json_config,
    legacy_expert_parallel,
    read_fsdp_dtensor,
    read_legacy,
)
from anyspeed.convert.pipeline import prefetch
from anyspeed.convert.reward import is_reward_model, reward_config, reward_mapping
from anyspeed.convert.torch_dist import read_torch_dist
from anyspeed.models.config import ModelConfig
from anyspeed.models.families import FamilyMapping, mapping_for
from anyspeed.models.hf import HF_ARCHITECTURES, hf_config

PRM_RECORD = "anyspeed_prm"  # a process reward model's placeholder and reward tokens


def _output_config(common: dict, preset: ModelConfig, hf_cfg_dir: str | Path | None) -> dict:
    """config.json of the output: ``hf_cfg_dir``'s (checked against the checkpoint's model), the
    one a conversion stored, or else described from the model (a directory with tokenizer files
    only gives those)."""
    if hf_cfg_dir and (Path(hf_cfg_dir) / "config.json").is_file():
        cfg = read_config(hf_cfg_dir)
        given = preset_of(cfg, None)
        # MTP layers are the checkpoint's to say (config.json's count is often a default)
        ours = dataclasses.replace(
            preset,
            name=given.name,
            vocab_size=given.vocab_size,
            mtp_num_layers=given.mtp_num_layers,
        )
        diff = given.same_architecture(ours)
        if diff or given.vocab_size > preset.vocab_size:
            name = (diff or ["vocab_size"])[0]
            raise ConvertError(
                f"--hf-cfg-dir {hf_cfg_dir}: config.json describes another model "
                f"({name} {getattr(given, name)!r} vs. the checkpoint's "
                f"{getattr(preset, name)!r})"
            )
        if preset.mtp_num_layers:
            cfg["num_nextn_predict_layers"] = preset.mtp_num_layers
        return cfg
    cfg = json_config(common)
    if cfg is None:  # a checkpoint anyspeed trained from scratch: describe it from the preset
        hf_vocab = common.get("anyspeed_convert", {}).get("hf_vocab_size", preset.vocab_size)
        try:
            described = hf_config(preset)
        except ValueError as exc:  # a model its family's HF class cannot express
            raise ConvertError(str(exc)) from None
        cfg = dict(described, vocab_size=hf_vocab, architectures=[HF_ARCHITECTURES[preset.family]])
    return cfg


def _hf_groups(m: FamilyMapping, preset: ModelConfig, groups: Iterator, vocab: int) -> Iterator:
    """The HF tensors of each group of Megatron tensors; after the head, the copies of the
    embedding and output layer each multi-token prediction layer keeps."""
    copies = engine.mtp_copies(m, preset)
    top: dict[str, torch.Tensor | engine.Stacked] = {}
    for g, tensors in groups:
        out = engine.to_hf(m, preset, g, tensors, vocab)
        if copies and not isinstance(g, int):
            top.update((k, v) for k, v in tensors.items() if k in engine.VOCAB)
        if copies and g == engine.HEAD:
            out.update((n, engine.take_rows(top[mg], [(0, vocab)])) for n, mg in copies.items())
        yield out


def _source_preset(
    common: dict, load_dir: str | Path, hf_cfg_dir: str | Path | None, model_type_hf: str | None
) -> ModelConfig:
    """The checkpoint's architecture: its record (or Megatron-LM's args), else ``hf_cfg_dir``'s
    config.json; ConvertError when neither says."""
    preset = model_in_common(common, load_dir, model_type_hf)
    if preset is None and hf_cfg_dir and (Path(hf_cfg_dir) / "config.json").is_file():
        preset = preset_of(read_config(hf_cfg_dir), model_type_hf)
    elif preset is None:
        raise ConvertError(
            f"{load_dir}: no {MODEL_KEY} or Megatron-LM args in the checkpoint: pass "
            "--hf-cfg-dir with the model's config.json"
        )
    return preset


def _saved_tp(common: dict) -> int:
    """The TP size a checkpoint was saved at (anyspeed's layout record, or Megatron-LM's args)."""
    if "anyspeed_layout" in common:
        return int(common["anyspeed_layout"].get("tp", 1))
    return int(getattr(common.get("args"), "tensor_model_parallel_size", 1) or 1)


def megatron_to_hf(
    load_dir: str | Path,
    save_dir: str | Path,
    hf_cfg_dir: str | Path | None = None,
    *,
    max_shard_size: str | int = "5GB",
    model_type_hf: str | None = None,
    lora: dict | None = None,
) -> Path:
    """Convert a Megatron checkpoint (torch_dist or legacy, any TP/PP; anyspeed's or
    Megatron-LM's) into an HF directory: config.json, sharded safetensors + index, and
    ``hf_cfg_dir``'s tokenizer files. The architecture comes from the checkpoint (anyspeed's
    model or Megatron-LM's args, family from ``model_type_hf``), else ``hf_cfg_dir``.
    ``lora`` (``{"load": dir, "r", "alpha", "target_modules"}``) merges a LoRA checkpoint's
    adapters into the weights first."""
    it_dir = checkpoint_dir(load_dir)
    fmt = checkpoint_format(it_dir)
    common = read_common(it_dir)
    preset = _source_preset(common, load_dir, hf_cfg_dir, model_type_hf)
    cfg = _output_config(common, preset, hf_cfg_dir)
    hf_vocab = int(cfg["vocab_size"])
    m = mapping_for(preset.family)
    if is_reward_model(common):  # --stage orm: *ForSequenceClassification, one label
        if fmt != "torch_dist" or lora:
            raise ConvertError(
                f"{load_dir}: a reward model converts from its torch_dist "
                "checkpoint, without --lora-load"
            )
        m, cfg = reward_mapping(m), reward_config(cfg)
    if PRM_RECORD in common:  # --stage prm: its step tokens travel with the export
        cfg[PRM_RECORD] = dict(common[PRM_RECORD])
    want = engine.hf_shapes(m, dataclasses.replace(preset, vocab_size=hf_vocab))
    # each MTP layer's copies of the embedding and output layer, written after the head
    want.update((n, (hf_vocab, preset.hidden_size)) for n in engine.mtp_copies(m, preset))
    if Path(save_dir).exists():
        raise ConvertError(f"--save-dir {save_dir} already exists (nothing was written)")
    if fmt == "torch_dist":
        groups = read_torch_dist(
            it_dir, preset, lambda g: list(engine.entries(m, preset, g)), engine.groups(preset)
        )
    elif fmt == "fsdp_dtensor":
        groups = read_fsdp_dtensor(it_dir, _saved_tp(common))
    else:
        groups = read_legacy(it_dir, legacy_expert_parallel(common), preset)
    if lora:
        from anyspeed.convert.lora import Adapters

        adapters = Adapters(lora["load"], preset)
        adapters.check(lora.get("r"), lora.get("alpha"), lora.get("target_modules"))
        groups = adapters.merged(groups)
    groups = prefetch(groups)  # read group N+1 while group N is written
    with staged_output(save_dir) as tmp:
        writer = ShardedWriter(tmp, list(want.items()), max_shard_size)
        seen, dtypes = set(), set()
        try:
            for out in _hf_groups(m, preset, groups, hf_vocab):
                for name, t in out.items():
                    if tuple(t.shape) != want[name]:
                        raise ConvertError(
                            f"{load_dir}: {name} has shape {list(t.shape)}, the "
                            f"config implies {list(want[name])}"
                        )
                    dtypes.add(str(t.dtype).removeprefix("torch."))
                writer.add(out)
                seen.update(out)
        except BaseException:
            writer.abort()
            raise
        if seen != set(want):
            raise ConvertError(f"{load_dir}: no tensors for {sorted(set(want) - seen)[:3]}")
        writer.close()
        if len(dtypes) == 1:  # the weights' dtype, as transformers records it
            (dtype,) = dtypes
            cfg.update({k: dtype for k in ("dtype", "torch_dtype") if k in cfg} or {"dtype": dtype})
        if hf_cfg_dir:
            copy_side_files(hf_cfg_dir, tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return Path(save_dir)
