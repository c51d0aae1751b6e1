"""LongRoPE (Phi-3.5, Phi-4-mini) on Megatron-Core's rotary embedding, as transformers computes it.

Each rotary frequency ``base^(-2i/d)`` is divided by its own factor: the short set while the
sequence a forward sees fits the pretraining length (``original_max_position_embeddings``),
the long set beyond it (transformers picks by the largest position + 1; Megatron hands the
rotary module that length: the sequence in training, the longest segment of packed ones).
cos and sin are multiplied by the attention factor ``sqrt(1 + ln(max / original) /
ln(original))``. Megatron-Core 0.16.1 has neither; the frequencies are a
:class:`LongRotaryEmbedding` in the model's ``rotary_pos_emb`` seat, and the attention factor
rides the concentration factor Megatron's attention (and anyspeed's decode paths) already
multiply cos and sin by, read from the ``TransformerConfig``'s YaRN attributes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from anyspeed.models.config import ModelConfig

FLAGS = (
    "--rope-scaling-type longrope needs --short-factor, --long-factor and "
    "--rope-scaling-original-max-position-embeddings"
)


def rotary_dim(model: ModelConfig) -> int:
    """Channels of each head that rotate (Megatron's and transformers' rounding)."""
    dim = model.head_dim
    return int(dim * model.rotary_percent) if model.rotary_percent < 1.0 else dim


def check_longrope(model: ModelConfig) -> None:
    """ValueError (one line, naming the flag) when the LongRoPE fields cannot build."""
    given = (
        model.longrope_short_factor,
        model.longrope_long_factor,
        model.longrope_original_max_position_embeddings,
    )
    if all(v is None for v in given):
        return
    if any(v is None for v in given):
        raise ValueError(FLAGS)
    half = rotary_dim(model) // 2
    for flag, factors in (
        ("--short-factor", model.longrope_short_factor),
        ("--long-factor", model.longrope_long_factor),
    ):
        assert factors is not None
        if len(factors) != half:
            raise ValueError(
                f"{flag} has {len(factors)} numbers; the {rotary_dim(model)} rotary channels of "
                f"each head need {half} (one per frequency)"
            )
        if any(not f > 0 for f in factors):
            raise ValueError(f"{flag}: every factor must be > 0")
    if model.longrope_original_max_position_embeddings < 1:  # type: ignore[operator]
        raise ValueError("--rope-scaling-original-max-position-embeddings must be >= 1")
    other = (
        model.multi_latent_attention
        or model.position_embedding_type != "rope"
        or model.rope_scaling
        or model.rotary_seq_len_interpolation_factor
        or model.rotary_base_local is not None
    )
    if other:
        raise ValueError(
            "--rope-scaling-type longrope scales plain RoPE: drop the other RoPE scaling "
            "(--use-rope-scaling, YaRN, --rotary-seq-len-interpolation-factor, "
            "--rotary-base-local, multi-latent attention)"
        )


def attention_factor(model: ModelConfig) -> float:
    """The factor on cos and sin: transformers' default from the two lengths (1 when the
    model's context is not longer than the pretraining one)."""
    original = float(model.longrope_original_max_position_embeddings or 1)
    factor = model.max_position_embeddings / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def set_longrope(config: Any, model: ModelConfig) -> None:
    """Megatron's attention multiplies cos and sin by YaRN's concentration factor
    ``(0.1 m ln s + 1) / (0.1 a ln s + 1)`` from the config's ``yarn_*`` attributes (1 without
    them); ``s = e``, ``m = 10 (f - 1)``, ``a = 0`` make it the attention factor ``f``. Only
    the plain-RoPE model reads them here (GPTModel builds YaRN for ``position_embedding_type
    yarn`` alone). RoPE fusion stays off: Megatron's fused entry for packed sequences drops
    the factor."""
    config.apply_rope_fusion = False
    config.yarn_rotary_scaling_factor = math.e
    config.yarn_mscale = 10.0 * (attention_factor(model) - 1.0)
    config.yarn_mscale_all_dim = 0.0


def _inv_freq(factors: tuple[float, ...], base: float, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponent)


def long_rotary_embedding(model: ModelConfig) -> torch.nn.Module:
    """The model's rotary module: Megatron's ``RotaryEmbedding`` with LongRoPE's two sets of
    frequencies, picked by the length each forward asks for."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class LongRotaryEmbedding(RotaryEmbedding):
        """Megatron's RoPE module whose frequencies are LongRoPE's short or long set."""

        def __init__(self) -> None:
            super().__init__(
                kv_channels=model.head_dim,
                rotary_percent=model.rotary_percent,
                rotary_base=int(model.rotary_base),
                use_cpu_initialization=True,
            )
            dim, base = rotary_dim(model), float(model.rotary_base)
            assert model.longrope_short_factor and model.longrope_long_factor
            self.short_inv_freq = _inv_freq(model.longrope_short_factor, base, dim)
            self.long_inv_freq = _inv_freq(model.longrope_long_factor, base, dim)
            self.original = int(model.longrope_original_max_position_embeddings or 0)
            self.inv_freq = self.short_inv_freq

        def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            longer = max_seq_len + offset > self.original
            chosen = self.long_inv_freq if longer else self.short_inv_freq
            self.inv_freq = chosen.to(self.inv_freq.device)
            return super().get_freqs_non_repeated(max_seq_len, offset)

        def get_rotary_seq_len(
            self, inference_context: Any, transformer: Any, *args: Any, **kwargs: Any
        ) -> int:
            """With a KV cache, the slots up to this forward's end (not the cache's
            capacity, Megatron's length): the set follows the sequence generated so far."""
            length = super().get_rotary_seq_len(inference_context, transformer, *args, **kwargs)
            packed = kwargs.get("packed_seq_params", args[2] if len(args) > 2 else None)
            if inference_context is None or packed is not None:
                return length
            given = transformer.input_tensor if transformer is not None else None
            tokens = (given if given is not None else args[0]).size(0)
            return min(length, inference_context.sequence_len_offset + tokens)

    return LongRotaryEmbedding()


def reencodes(chunks: list[Any], start: int, end: int) -> bool:
    """Whether a cached forward of slots ``start..end`` crosses the pretraining length of a
    LongRoPE model: transformers then drops its cache and encodes the sequence again with the
    long set (the cached keys were rotated by the short one)."""
    for chunk in chunks:
        original = getattr(getattr(chunk, "rotary_pos_emb", None), "original", None)
        if original is not None:
            return 0 < start <= original < end
    return False
