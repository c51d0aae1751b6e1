"""``anyspeed convert`` for LLaVA: ``LlavaForConditionalGeneration`` <-> a Megatron torch_dist
checkpoint of ``LLaVAModel`` (loadable at any TP), and ``--verify`` on an image and tokens.

The whole model is converted in memory (tensor names: :mod:`anyspeed.convert.llava`) and written
or read by Megatron's own ``dist_checkpointing`` through a one-rank ``LLaVAModel``. The checkpoint
records the language model (as every anyspeed checkpoint does), the tower and image-token rule
(``anyspeed_llava``) and the HF config, so it converts back with no other file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from anyspeed.convert import llava as conv
from anyspeed.convert.api import write_hf_dir
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.hf_io import HFCheckpoint, read_config
from anyspeed.models.config import padded_vocab_size
from anyspeed.models.vision import RECORD, LlavaConfig, from_record, llava_from_hf, record

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_llava_config(config: dict[str, Any]) -> bool:
    """Whether an HF config.json describes a ``LlavaForConditionalGeneration``."""
    return config.get("model_type") == "llava" or "LlavaForConditionalGeneration" in (
        config.get("architectures") or []
    )


def is_llava_checkpoint(common: dict[str, Any]) -> bool:
    """Whether a checkpoint's common state records a LLaVA model (``anyspeed_llava``)."""
    return RECORD in common


def holds_llava(load_dir: str | Path, model_type: str) -> bool:
    """Whether ``load_dir`` holds a LLaVA model: an HF directory (``model_type`` "hf") whose
    config.json says so, or a Megatron checkpoint whose record does."""
    load = Path(load_dir)
    if model_type == "hf":
        return (load / "config.json").is_file() and is_llava_config(read_config(load))
    from anyspeed.checkpoint.reads import checkpoint_dir, read_common

    try:
        return is_llava_checkpoint(read_common(checkpoint_dir(load)))
    except Exception:  # noqa: BLE001 - not readable here: the GPT path reports it
        return False


def _config(hf_config: dict[str, Any]) -> LlavaConfig:
    try:
        return llava_from_hf(hf_config)
    except ValueError as exc:
        raise ConvertError(f"config.json: {exc}") from None


def build_model(cfg: LlavaConfig, dtype: torch.dtype):
    """A one-rank ``LLaVAModel`` of ``cfg`` in ``dtype``, weights uninitialised."""
    from anyspeed.models import gpt, multimodal

    config = gpt.transformer_config(
        cfg.language,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        perform_initialization=False,
    )
    return multimodal.build_llava(cfg, config)


def hf_to_megatron(
    hf_dir: str | Path,
    save_dir: str | Path,
    *,
    tp: int = 1,
    ckpt_format: str = "torch_dist",
    make_vocab_size_divisible_by: int = 1,
    params_dtype: str | None = None,
) -> Path:
    """An HF LLaVA directory -> a torch_dist checkpoint at ``save_dir`` (vocabulary padded to a
    multiple of ``make_vocab_size_divisible_by`` x ``tp``)."""
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.files import RELEASE, iteration_dir, write_tracker
    from anyspeed.convert.api import staged_output
    from anyspeed.convert.megatron_io import common_state, megatron_session

    if ckpt_format != "torch_dist":
        raise ConvertError(
            f"--ckpt-format {ckpt_format}: LLaVA converts to torch_dist only (it loads at any TP)"
        )
    ck = HFCheckpoint(hf_dir)
    cfg = _config(ck.config)
    layout = conv.layout_of(ck.names)
    embed = conv.hf_name("model.language_model.embed_tokens.weight", layout)
    dtype = DTYPES[params_dtype] if params_dtype else ck.dtype(embed)
    padded = padded_vocab_size(cfg.language.vocab_size, max(1, make_vocab_size_divisible_by), tp)
    state = conv.to_megatron(cfg, lambda n: ck.get(conv.hf_name(n, layout)).to(dtype), padded)
    mg = cfg.with_language(vocab_size=padded)
    extra = {
        "hf_config_json": json.dumps(ck.config),
        "hf_vocab_size": cfg.language.vocab_size,
        "hf_layout": layout,
    }
    with staged_output(save_dir) as tmp, megatron_session():
        model = build_model(mg, dtype)
        conv.load_into(model, state, 1, 0)
        common = {
            **common_state(mg.language, 0, extra),
            RECORD: record(cfg, ck.config),
            "anyspeed_dtype": {v: k for k, v in DTYPES.items()}[dtype],
        }
        release = Path(iteration_dir(tmp, RELEASE))
        release.mkdir()
        dist_checkpointing.save({"model": model.sharded_state_dict(), **common}, str(release))
        write_tracker(tmp, RELEASE)
    return Path(save_dir)


def _hf_config(common: dict[str, Any], hf_cfg_dir: str | Path | None) -> dict[str, Any]:
    saved = common.get("anyspeed_convert", {}).get("hf_config_json") or json.loads(
        common[RECORD]
    ).get("hf_config")
    if saved:
        return json.loads(saved) if isinstance(saved, str) else saved
    if hf_cfg_dir and (Path(hf_cfg_dir) / "config.json").is_file():
        return read_config(hf_cfg_dir)
    raise ConvertError(
        "the checkpoint records no HF config: pass --hf-cfg-dir with the model's config.json"
    )


def load_megatron(load_dir: str | Path) -> tuple[torch.nn.Module, LlavaConfig, dict[str, Any]]:
    """The checkpoint's model (one rank, TP1, eval; inside a megatron session), its config
    and common state."""
    from anyspeed.checkpoint.load import load_weights
    from anyspeed.checkpoint.reads import checkpoint_dir, read_common
    from anyspeed.checkpoint.record import model_in_common

    common = read_common(checkpoint_dir(load_dir))
    if not is_llava_checkpoint(common):
        raise ConvertError(f"{load_dir}: not a LLaVA checkpoint (no {RECORD})")
    cfg = from_record(common[RECORD], model_in_common(common, load_dir, as_hf=False))
    dtype = DTYPES.get(str(common.get("anyspeed_dtype", "fp32")), torch.float32)
    model = build_model(cfg, dtype)
    load_weights(str(load_dir), [model])
    return model.eval(), cfg, common


def megatron_to_hf(
    load_dir: str | Path,
    save_dir: str | Path,
    hf_cfg_dir: str | Path | None = None,
    *,
    max_shard_size: str | int = "5GB",
) -> Path:
    """A LLaVA torch_dist checkpoint (converted or trained at any TP) -> an HF directory."""
    from anyspeed.convert.megatron_io import megatron_session

    with megatron_session():
        model, cfg, common = load_megatron(load_dir)
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf_config = _hf_config(common, hf_cfg_dir)
    vocab = int(_config(hf_config).language.vocab_size)
    layout = common.get("anyspeed_convert", {}).get("hf_layout", "saved")
    out = conv.to_hf(cfg.with_language(vocab_size=vocab), state)
    named = {conv.hf_name(k, layout): t for k, t in out.items()}
    write_hf_dir(save_dir, named, hf_config, hf_cfg_dir, max_shard_size)
    return Path(save_dir)


def verify(hf_dir: str | Path, mg_dir: str | Path, tolerance: float = 1e-4) -> float:
    """Max-abs difference of the two models' logits (fp32) on a random image and tokens;
    ConvertError above ``tolerance``."""
    import transformers

    from anyspeed.convert.megatron_io import megatron_session

    transformers.utils.logging.disable_progress_bar()
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(0)
    with megatron_session():
        model, cfg, _ = load_megatron(mg_dir)
        model = model.float()
        size, n = cfg.vision.image_size, cfg.image_seq_len
        images = torch.randn(1, 3, size, size, generator=g)
        text = torch.randint(0, max(2, cfg.image_token_id), (1, 12), generator=g)
        text[text == cfg.image_token_id] = 0
        one = torch.full((1, 1), cfg.image_token_id)
        with torch.no_grad():
            mine, _ = model(images, torch.cat([text[:, :4], one, text[:, 4:]], 1), None, None)
            ref = hf(
                input_ids=torch.cat([text[:, :4], one.expand(1, n), text[:, 4:]], 1),
                pixel_values=images,
            ).logits
    diff = float((mine[..., : ref.shape[-1]].float() - ref.float()).abs().max())
    if not diff <= tolerance:
        raise ConvertError(f"--verify: logits differ by {diff:.3g} (tolerance {tolerance:g})")
    return diff
