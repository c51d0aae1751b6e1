"""Tiny random Qwen2-VL / Qwen2.5-VL configurations (transformers) for the Qwen-VL tests, and
the special token ids they use."""

from __future__ import annotations

from typing import Any

IMAGE, VIDEO, START, END = 250, 251, 252, 253


def hf_config(kind: str, vision_extra: dict | None = None, **text: Any) -> Any:
    """A tiny ``qwen2_vl`` / ``qwen2_5_vl`` config (vision: width 32, patch 2, merge 2; text:
    hidden 64, 4/2 heads, head_dim 16, vocab 256); ``text`` and ``vision_extra`` override."""
    import transformers

    text = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            **text}  # fmt: skip
    if kind == "qwen2_vl":
        vision = {"embed_dim": 32, "depth": 1, "num_heads": 4, "patch_size": 2, "hidden_size": 64}
        vision.update(vision_extra or {})
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision)
    else:
        vision = {"hidden_size": 32, "depth": 1, "num_heads": 4, "patch_size": 2,
                  "intermediate_size": 48, "out_hidden_size": 64,
                  "tokens_per_second": 4}  # fmt: skip
        vision.update(vision_extra or {})
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    cfg.image_token_id, cfg.video_token_id = IMAGE, VIDEO
    cfg.vision_start_token_id, cfg.vision_end_token_id = START, END
    return cfg


def seconds_per_grid() -> float:
    """The seconds per temporal grid the Qwen2.5-VL tests give their video: 0.5 (a fraction, so
    that the time spacing is exercised) where transformers keeps it; 1.0 where transformers'
    ``get_rope_index`` truncates it to an integer first (its bug before huggingface/transformers
    PR 48669; 5.17 has it), which would collapse the reference's video times to one."""
    import inspect

    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    source = inspect.getsource(Qwen2_5_VLModel.get_rope_index)
    return 1.0 if "int(next(second_per_grid_ts))" in source else 0.5
