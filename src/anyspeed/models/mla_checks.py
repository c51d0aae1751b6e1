"""The checks of multi-latent attention settings (no torch import: the model type uses it)."""

from __future__ import annotations

from typing import Any


def check_mla(model: Any) -> None:
    """ValueError (one line, naming the flag) when the MLA settings cannot build."""
    if not model.multi_latent_attention:
        return
    if not model.qk_layernorm:
        raise ValueError(
            "--multi-latent-attention needs --qk-layernorm: without it Megatron drops the "
            "latent KV norm (kv_layernorm) silently"
        )
    if model.position_embedding_type != "rope":
        raise ValueError("--multi-latent-attention needs --position-embedding-type rope")
