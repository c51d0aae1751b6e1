"""The checks of multi-latent attention settings (no torch import: the model type uses it)."""

from __future__ import annotations

from typing import Any


def check_mla(model: Any) -> None:
    """ValueError (one line, naming the flag) when the MLA settings cannot build."""
    if not model.multi_latent_attention:
        if model.experimental_attention_variant == "dsa":
            raise ValueError(
                "--experimental-attention-variant dsa is sparse multi-latent attention: "
                "add --multi-latent-attention"
            )
        return
    if not model.qk_layernorm:
        raise ValueError(
            "--multi-latent-attention needs --qk-layernorm: without it Megatron drops the "
            "latent KV norm (kv_layernorm) silently"
        )
    if model.position_embedding_type != "rope":
        raise ValueError("--multi-latent-attention needs --position-embedding-type rope")
    if model.experimental_attention_variant == "dsa":
        _check_dsa(model)


def _check_dsa(model: Any) -> None:
    """DeepSeek-V3.2's sparse attention: the indexer's sizes, on MLA."""
    sizes = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
    missing = ["--" + f.replace("_", "-") for f in sizes if getattr(model, f) is None]
    if missing:
        raise ValueError(f"--experimental-attention-variant dsa needs {', '.join(missing)}")
    if model.dsa_indexer_head_dim < model.qk_pos_emb_head_dim:
        raise ValueError(
            "--dsa-indexer-head-dim must be at least --qk-pos-emb-head-dim (the indexer "
            "rotates that many channels of each head)"
        )
