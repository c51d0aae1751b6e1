"""``hf_to_megatron`` / ``megatron_to_hf``: validation first, then one group at a time into a
temporary directory that is renamed to the final name only when everything is written."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from anyspeed.checkpoint.megatron_lm_args import family_for
from anyspeed.checkpoint.reads import checkpoint_dir, checkpoint_format, read_common
from anyspeed.checkpoint.record import MODEL_KEY, model_in_common
from anyspeed.convert import engine
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.hf_io import (
    HFCheckpoint,
    ShardedWriter,
    copy_side_files,
    read_config,
)
from anyspeed.convert.megatron_io import (
    common_state,
    json_config,
    legacy_expert_parallel,
    read_legacy,
    save_legacy,
)
from anyspeed.convert.pipeline import prefetch
from anyspeed.convert.reward import is_reward_model, reward_config, reward_mapping
from anyspeed.convert.torch_dist import read_torch_dist, save_torch_dist
from anyspeed.layout import Layout, uneven_stages
from anyspeed.models.config import ModelConfig, padded_vocab_size
from anyspeed.models.families import FamilyMapping, mapping_for
from anyspeed.models.hf import HF_ARCHITECTURES, hf_config, preset_from_hf

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


def _preset(config: dict, model_type_hf: str | None) -> ModelConfig:
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


def with_mtp(preset: ModelConfig, names: list[str] | set[str], want: int | None = None
             ) -> ModelConfig:  # fmt: skip
    """``preset`` with the multi-token prediction layers the checkpoint's tensor ``names``
    hold (DeepSeek-V3 keeps them as HF layers after the last; transformers' own models and
    checkpoints saved from them have none, whatever config.json says), or its first ``want``."""
    m = mapping_for(preset.family)
    have, n = set(names), 0
    while m.mtp and m.hf_layer.format(i=preset.num_layers + n) + "eh_proj.weight" in have:
        n += 1
    if want is not None and not 0 <= want <= n:
        raise ConvertError(f"--mtp-num-layers {want}: the checkpoint holds {n} multi-token "
                           "prediction layers")  # fmt: skip
    return dataclasses.replace(preset, mtp_num_layers=(n if want is None else want) or None)


def hf_dir_preset(hf_dir: str | Path, model_type_hf: str | None = None) -> ModelConfig:
    """The model an HF directory holds: its config.json and, for MTP, its tensors."""
    ck = HFCheckpoint(hf_dir)
    return with_mtp(_preset(ck.config, model_type_hf), ck.names)


def check_target(
    preset: ModelConfig,
    tp: int,
    pp: int,
    num_layer_list: str | None = None,
    ep: int = 1,
    ckpt_format: str = "torch_dist",
) -> list[int]:
    """The layers of each pipeline stage; one-line error when Megatron cannot lay the model
    out at TP x PP (with ``num_layer_list``, MindSpeed-LLM's uneven stages)."""
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
        layout = Layout(tp=1 if biased_experts else tp, pp=pp, ep=ep,
                        sequence_parallel=tp > 1 and not biased_experts,
                        **uneven_stages(pp, None, None, num_layer_list))  # fmt: skip
        if num_layer_list and sum(map(int, num_layer_list.split(","))) != preset.num_layers:
            raise ValueError(f"--num-layer-list {num_layer_list} does not add up to the "
                             f"model's {preset.num_layers} layers")  # fmt: skip
        layout.validate_for(tp * pp * ep, preset)
        _tp_divisible(preset, tp)
        return layout.stage_layers(preset.num_layers)
    except ValueError as exc:
        msg = (
            str(exc)
            .replace("--tensor-model", "--target-tensor")
            .replace("--pipeline-model", "--target-pipeline")
            .replace("--expert-model-parallel-size", "--target-expert-parallel-size")
        )
        raise ConvertError(msg) from None


def _tp_divisible(preset: ModelConfig, tp: int) -> None:
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


def _check_hf_tensors(ck: HFCheckpoint, preset: ModelConfig) -> None:
    """Every tensor the architecture needs is there with the shape config.json implies."""
    m = mapping_for(preset.family)
    want = engine.hf_shapes(m, preset)
    have = {n for n in ck.names if not n.endswith(m.ignored_hf)}
    have -= set(engine.mtp_copies(m, preset))  # copies of the embedding and output layer
    if m.mtp:  # MTP layers left out (--mtp-num-layers)
        kept = preset.num_layers + (preset.mtp_num_layers or 0)
        have = {n for n in have if not engine.hf_layer_at_least(m, n, kept)}
    if preset.tie_embeddings:
        have.discard("lm_head.weight")  # some tied checkpoints store it anyway
    for name in sorted(want):
        if name not in have:
            raise ConvertError(f"{ck.dir}: tensor {name} is missing")
        if ck.shape(name) != want[name]:
            raise ConvertError(
                f"{ck.dir}: tensor {name} has shape {list(ck.shape(name))}, "
                f"config.json implies {list(want[name])}"
            )
    extra = sorted(have - set(want))
    if extra:
        raise ConvertError(
            f"{ck.dir}: unexpected tensor {extra[0]} for {HF_ARCHITECTURES[preset.family]}"
        )


def hf_to_megatron(
    hf_dir: str | Path,
    save_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ckpt_format: str = "torch_dist",
    model_type_hf: str | None = None,
    make_vocab_size_divisible_by: int = 1,
    params_dtype: str | None = None,
    num_layer_list: str | None = None,
    ep: int = 1,
    mtp_num_layers: int | None = None,
) -> Path:
    """Convert an HF directory into a Megatron checkpoint at ``save_dir``.

    ``torch_dist`` loads at any layout (``tp`` only sets the vocabulary padding); ``legacy``
    is split for ``tp`` x ``pp``. The vocabulary is padded to a multiple of
    ``make_vocab_size_divisible_by x tp`` with zero rows.
    """
    if ckpt_format not in ("torch_dist", "legacy"):
        raise ConvertError(f"--ckpt-format {ckpt_format}: choose torch_dist or legacy")
    ck = HFCheckpoint(hf_dir)
    preset = with_mtp(_preset(ck.config, model_type_hf), ck.names, mtp_num_layers)
    counts = check_target(preset, tp, pp, num_layer_list, ep, ckpt_format)
    _check_hf_tensors(ck, preset)
    if Path(save_dir).exists():
        raise ConvertError(f"--save-dir {save_dir} already exists (nothing was written)")
    m = mapping_for(preset.family)
    padded = padded_vocab_size(preset.vocab_size, max(1, make_vocab_size_divisible_by), tp)
    mg_preset = dataclasses.replace(preset, vocab_size=padded)
    dtype = DTYPES[params_dtype] if params_dtype else ck.dtype("model.embed_tokens.weight")

    def read(name: str) -> torch.Tensor:
        return ck.get(name, mapped=True).to(dtype)

    def group(
        g: engine.Group, stacked: bool = False, keep: Callable[[str], bool] | None = None
    ) -> dict[str, torch.Tensor | engine.Stacked]:
        return engine.to_megatron(m, preset, g, read, padded, stacked, keep)

    extra = {"hf_config_json": json.dumps(ck.config), "hf_vocab_size": preset.vocab_size,
             "expert_model_parallel_size": ep}  # fmt: skip
    with staged_output(save_dir) as tmp:
        if ckpt_format == "torch_dist":
            common = common_state(mg_preset, 0, extra)
            save_torch_dist(
                tmp, mg_preset, dtype, (group(g, True) for g in engine.groups(preset)), common
            )
        else:
            starts = [sum(counts[:s]) for s in range(pp + 1)]

            def stage(
                s: int, keep: Callable[[str], bool] | None = None
            ) -> Iterator[dict[str, torch.Tensor | engine.Stacked]]:
                if s == 0:
                    yield group(engine.EMBED, True, keep)
                for i in range(starts[s], starts[s + 1]):
                    yield group(i, True, keep)
                if s == pp - 1:
                    for j in range(preset.mtp_num_layers or 0):  # MTP: on the last stage
                        yield group(preset.num_layers + j, True, keep)
                    if preset.mtp_num_layers and pp > 1:  # with its copy of the embedding
                        yield group(engine.EMBED, True, keep)
                    yield group(engine.HEAD, True, keep)
                    if preset.tie_embeddings and pp > 1:  # the last stage's copy of the tie
                        emb = group(engine.EMBED, True)["embedding.word_embeddings.weight"]
                        yield {"output_layer.weight": emb}

            save_legacy(tmp, mg_preset, tp, counts, stage, common_state(mg_preset, 1, extra), ep)
    return Path(save_dir)


def _output_config(common: dict, preset: ModelConfig, hf_cfg_dir: str | Path | None) -> dict:
    """config.json of the output: ``hf_cfg_dir``'s (checked against the checkpoint's model), the
    one a conversion stored, or else described from the model (a directory with tokenizer files
    only gives those)."""
    if hf_cfg_dir and (Path(hf_cfg_dir) / "config.json").is_file():
        cfg = read_config(hf_cfg_dir)
        given = _preset(cfg, None)
        # MTP layers are the checkpoint's to say (config.json's count is often a default)
        ours = dataclasses.replace(preset, name=given.name, vocab_size=given.vocab_size,
                                   mtp_num_layers=given.mtp_num_layers)  # fmt: skip
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
        cfg = dict(described, vocab_size=hf_vocab,
                   architectures=[HF_ARCHITECTURES[preset.family]])  # fmt: skip
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
    preset = model_in_common(common, load_dir, model_type_hf)
    if preset is None and hf_cfg_dir and (Path(hf_cfg_dir) / "config.json").is_file():
        preset = _preset(read_config(hf_cfg_dir), model_type_hf)
    elif preset is None:
        raise ConvertError(
            f"{load_dir}: no {MODEL_KEY} or Megatron-LM args in the checkpoint: pass "
            "--hf-cfg-dir with the model's config.json"
        )
    cfg = _output_config(common, preset, hf_cfg_dir)
    hf_vocab = int(cfg["vocab_size"])
    m = mapping_for(preset.family)
    if is_reward_model(common):  # --stage orm: *ForSequenceClassification, one label
        if fmt != "torch_dist" or lora:
            raise ConvertError(f"{load_dir}: a reward model converts from its torch_dist "
                               "checkpoint, without --lora-load")  # fmt: skip
        m, cfg = reward_mapping(m), reward_config(cfg)
    want = engine.hf_shapes(m, dataclasses.replace(preset, vocab_size=hf_vocab))
    # each MTP layer's copies of the embedding and output layer, written after the head
    want.update((n, (hf_vocab, preset.hidden_size)) for n in engine.mtp_copies(m, preset))
    if Path(save_dir).exists():
        raise ConvertError(f"--save-dir {save_dir} already exists (nothing was written)")
    if fmt == "torch_dist":
        groups = read_torch_dist(
            it_dir, preset, lambda g: list(engine.entries(m, preset, g)), engine.groups(preset)
        )
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
                        raise ConvertError(f"{load_dir}: {name} has shape {list(t.shape)}, the "
                                           f"config implies {list(want[name])}")  # fmt: skip
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
