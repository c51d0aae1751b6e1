"""``anyspeed convert`` for Qwen2-VL / Qwen2.5-VL: the HF model <-> a Megatron torch_dist
checkpoint of :class:`~anyspeed.models.qwen_vl.model.QwenVLModel` (loadable at any TP), and
``--verify`` on an image, a video and text.

The whole model is converted in memory (tensor names: :mod:`anyspeed.convert.qwen_vl`) and
written or read by Megatron's ``dist_checkpointing`` through a one-rank model. The checkpoint
carries what ``posttrain --stage vlm`` records (``anyspeed_qwen_vl``: the HF config, the image
processor's settings, the tokenizer's directory), so it trains, and converts back, on its own.
HF -> Megatron -> HF is byte-identical, in the weight-name spelling the source used.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from anyspeed.convert import qwen_vl as conv
from anyspeed.convert.api import write_hf_dir
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.hf_io import HFCheckpoint, read_config
from anyspeed.convert.llava_api import DTYPES
from anyspeed.models.config import ModelConfig, padded_vocab_size
from anyspeed.models.qwen_vl.config import tower_from_hf
from anyspeed.models.qwen_vl.spec import RECORD, QwenVLSpec, is_qwen_vl, record

MERGES_LORA = True  # mg -> hf takes --lora-load (adapters on the language model)


def holds_qwen_vl(load_dir: str | Path, model_type: str) -> bool:
    """Whether ``load_dir`` holds a Qwen-VL model (an HF directory's config.json, or a
    checkpoint's record says so)."""
    load = Path(load_dir)
    if model_type == "hf":
        return (load / "config.json").is_file() and is_qwen_vl(read_config(load))
    from anyspeed.checkpoint.reads import checkpoint_dir, read_common

    try:
        return RECORD in read_common(checkpoint_dir(load))
    except Exception:  # noqa: BLE001 - not readable here: the GPT path reports it
        return False


def build_model(hf_config: dict[str, Any], language: ModelConfig, dtype: torch.dtype):
    """A one-rank QwenVLModel (weights uninitialised) inside a megatron session."""
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.qwen_vl.model import QwenVLModel
    from anyspeed.models.qwen_vl.tower import tower_transformer_config

    cfg = QwenVLSpec(hf_config, language, {})
    kw = {"perform_initialization": False}
    config = gpt.transformer_config(
        language,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **kw,
    )
    tower_config = tower_transformer_config(cfg.tower, Layout(), dtype, **kw)
    return QwenVLModel(cfg.tower, tower_config, language, config, cfg.tokens)


def _layout(names: list[str]) -> str:
    """``old`` when the checkpoint spells the tower ``visual.*`` (the Hub's, and what
    transformers 5's ``save_pretrained`` still writes), else ``new``."""
    return "old" if any(n.startswith("visual.") for n in names) else "new"


def _spelled(name: str, layout: str) -> str:
    """A transformers-5 name in the ``old`` spelling when asked."""
    if layout != "old":
        return name
    if name.startswith(conv.VISUAL):
        return name[len("model.") :]
    if name.startswith(conv.LANGUAGE):
        return "model." + name[len(conv.LANGUAGE) :]
    return name


def hf_to_megatron(
    hf_dir: str | Path,
    save_dir: str | Path,
    *,
    tp: int = 1,
    ckpt_format: str = "torch_dist",
    make_vocab_size_divisible_by: int = 1,
    params_dtype: str | None = None,
) -> Path:
    """An HF Qwen-VL directory -> a torch_dist checkpoint at ``save_dir`` (vocabulary padded
    to a multiple of ``make_vocab_size_divisible_by`` x ``tp``)."""
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.files import RELEASE, iteration_dir, write_tracker
    from anyspeed.convert.api import staged_output
    from anyspeed.convert.megatron_io import common_state, megatron_session
    from anyspeed.data.qwen_vl_pixels import processor_settings

    if ckpt_format != "torch_dist":
        raise ConvertError(f"--ckpt-format {ckpt_format}: Qwen-VL converts to torch_dist only")
    ck = HFCheckpoint(hf_dir)
    names = {conv.current_name(n): n for n in ck.names}
    preset = conv.language_preset(ck.config)
    dtype = DTYPES[params_dtype] if params_dtype else ck.dtype(ck.names[0])
    padded = padded_vocab_size(preset.vocab_size, max(1, make_vocab_size_divisible_by), tp)
    _, _, state = conv.model_to_megatron(ck.config, lambda n: ck.get(names[n]).to(dtype), padded)
    language = dataclasses.replace(preset, vocab_size=padded)
    vc = ck.config["vision_config"]
    settings = processor_settings(
        str(hf_dir),
        int(vc["patch_size"]),
        int(vc.get("spatial_merge_size", 2)),
        int(vc.get("temporal_patch_size", 2)),
    )
    has_tokenizer = (Path(hf_dir) / "tokenizer.json").is_file()
    tokenizer = str(Path(hf_dir).resolve()) if has_tokenizer else None
    extra = {
        "hf_config_json": json.dumps(ck.config),
        "hf_vocab_size": preset.vocab_size,
        "hf_layout": _layout(ck.names),
    }
    with staged_output(save_dir) as tmp, megatron_session():
        model = build_model(ck.config, language, dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        common = {
            **common_state(language, 0, extra),
            RECORD: record(ck.config, settings, tokenizer),
            "anyspeed_dtype": {v: k for k, v in DTYPES.items()}[dtype],
        }
        release = Path(iteration_dir(tmp, RELEASE))
        release.mkdir()
        dist_checkpointing.save({"model": model.sharded_state_dict(), **common}, str(release))
        write_tracker(tmp, RELEASE)
    return Path(save_dir)


def load_megatron(load_dir: str | Path) -> tuple[torch.nn.Module, dict[str, Any], dict]:
    """The checkpoint's model (one rank, TP1, eval; inside a megatron session), its HF config
    and common state; converted or trained at any TP."""
    from anyspeed.checkpoint.load import load_weights
    from anyspeed.checkpoint.reads import checkpoint_dir, read_common
    from anyspeed.checkpoint.record import model_in_common

    common = read_common(checkpoint_dir(load_dir))
    if RECORD not in common:
        raise ConvertError(f"{load_dir}: not a Qwen-VL checkpoint (no {RECORD})")
    hf_config = json.loads(common[RECORD])["hf_config"]
    language = model_in_common(common, load_dir, as_hf=False)
    dtype = DTYPES.get(str(common.get("anyspeed_dtype", "fp32")), torch.float32)
    model = build_model(hf_config, language, dtype)
    load_weights(str(load_dir), [model])
    return model.eval(), hf_config, common


def megatron_to_hf(
    load_dir: str | Path,
    save_dir: str | Path,
    hf_cfg_dir: str | Path | None = None,
    *,
    max_shard_size: str | int = "5GB",
    lora: dict | None = None,
) -> Path:
    """A Qwen-VL torch_dist checkpoint (converted, or trained at any TP) -> an HF directory;
    ``lora`` (``{"load": dir, "r", "alpha", "target_modules"}``) merges the adapters of a LoRA
    run on the language model into it first (W + alpha / r * B A)."""
    from anyspeed.convert.megatron_io import megatron_session

    with megatron_session():
        model, hf_config, common = load_megatron(load_dir)
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tower, preset = tower_from_hf(hf_config["vision_config"]), conv.language_preset(hf_config)
    if lora:
        _merge(state, lora, dataclasses.replace(preset, vocab_size=model.language_model.vocab_size))
    layout = common.get("anyspeed_convert", {}).get("hf_layout", "old")  # save_pretrained's
    named = {_spelled(k, layout): t for k, t in conv.model_to_hf(tower, preset, state).items()}
    write_hf_dir(save_dir, named, hf_config, hf_cfg_dir or _start_dir(common), max_shard_size)
    return Path(save_dir)


def _merge(state: dict[str, torch.Tensor], lora: dict, preset: ModelConfig) -> None:
    """Add each adapted language-model weight's ``alpha / r * B @ A`` (fp32) in place."""
    from anyspeed.convert.lora import Adapters

    adapters = Adapters(lora["load"], preset, prefix="language_model.")
    adapters.check(lora.get("r"), lora.get("alpha"), lora.get("target_modules"))
    merged = 0
    for name, w in state.items():
        ab = adapters.pair(name)
        if ab is not None:
            delta = ab[1].float() @ ab[0].float() * adapters.scale
            state[name] = (w.float() + delta).to(w.dtype)
            merged += 1
    if not merged:
        raise ConvertError(f"--lora-load {lora['load']}: no adapter fits the model's layers")


def _start_dir(common: dict[str, Any]) -> str | None:
    """The HF directory the checkpoint's run started from, where it still is."""
    path = json.loads(common[RECORD]).get("tokenizer")
    return path if path and Path(path, "config.json").is_file() else None


def verify(hf_dir: str | Path, mg_dir: str | Path, tolerance: float = 1e-4) -> float:
    """Max-abs difference of the two models' logits (fp32) on a random 2-frame image, a
    4-frame video and text around them; ConvertError above ``tolerance``."""
    import transformers

    from anyspeed.convert.megatron_io import megatron_session

    transformers.utils.logging.disable_progress_bar()
    config = read_config(hf_dir)
    cls = getattr(transformers, config["architectures"][0])
    hf = cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with megatron_session():
        model, hf_config, _ = load_megatron(mg_dir)
        inputs = _verify_inputs(hf_config)
        with torch.no_grad():
            mine = model.float()(**inputs)
            ids = inputs["input_ids"]
            types = (ids == hf_config["image_token_id"]).int()
            types += 2 * (ids == hf_config["video_token_id"]).int()
            ref = hf(mm_token_type_ids=types, **inputs).logits
    diff = float((mine[..., : ref.shape[-1]].float() - ref.float()).abs().max())
    if not diff <= tolerance:
        raise ConvertError(f"--verify: logits differ by {diff:.3g} (tolerance {tolerance:g})")
    return diff


def _verify_inputs(c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An 8 x 12-patch image and a 4-frame 8 x 8-patch video between random text tokens."""
    vc = c["vision_config"]
    p, m, t = int(vc["patch_size"]), int(vc.get("spatial_merge_size", 2)), 2
    dim = int(vc.get("in_channels", 3)) * t * p * p
    g = torch.Generator().manual_seed(0)
    image, video = torch.tensor([[1, 8, 12]]), torch.tensor([[2, 8, 8]])
    vision = {
        c[k]
        for k in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        )
    }
    vocab = int((c.get("text_config") or c)["vocab_size"])
    allowed = torch.tensor([i for i in range(vocab) if i not in vision])
    text = allowed[torch.randint(0, len(allowed), (1, 12), generator=g)]

    def block(token: int, grid: torch.Tensor) -> torch.Tensor:
        n = int(grid.prod()) // m**2
        return torch.tensor([[c["vision_start_token_id"], *[token] * n, c["vision_end_token_id"]]])

    ids = torch.cat(
        [
            text[:, :4],
            block(c["image_token_id"], image),
            text[:, 4:8],
            block(c["video_token_id"], video),
            text[:, 8:],
        ],
        1,
    )
    inputs = {
        "input_ids": ids,
        "pixel_values": torch.randn(int(image.prod()), dim, generator=g),
        "image_grid_thw": image,
        "pixel_values_videos": torch.randn(int(video.prod()), dim, generator=g),
        "video_grid_thw": video,
    }
    if c.get("model_type") == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([1.0])
    return inputs
