"""``no-grad-fast-path``: under no-grad Megatron's linear entry point is a plain matmul (and
untouched with grad on); with the static KV cache, queries and keys rotated when stored give
attention the same tensors as Megatron's re-rotation of the whole cache, step after step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


@pytest.fixture
def applied():
    from anyspeed import adaptor

    adaptor.apply(argv=[])
    yield
    adaptor.undo()


def test_linear_is_a_plain_matmul_without_grad_and_megatron_with_grad(applied) -> None:
    from megatron.core.tensor_parallel import layers

    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((3, 2, 8), (5, 8), (5,)))
    ref = x @ w.T + b
    with torch.no_grad():
        out = layers.linear_with_grad_accumulation_and_async_allreduce(x, w, b, False, False,
                                                                        False)  # fmt: skip
    torch.testing.assert_close(out, ref)
    wg = w.clone().requires_grad_()
    out = layers.linear_with_grad_accumulation_and_async_allreduce(x, wg, b, False, False, False)
    assert "LinearWithGradAccumulation" in type(out.grad_fn).__name__  # Megatron's own node
    torch.testing.assert_close(out.detach(), ref)


def _attention_stub(config, groups: int):
    from megatron.core.transformer.enums import AttnMaskType

    def allocate(seq, batch, dim, dtype):
        return torch.zeros(seq, batch, groups, dim, dtype=dtype)

    return SimpleNamespace(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                           key_hidden_size=16, val_hidden_size=16, training=False,
                           pg_collection=SimpleNamespace(cp=object()),
                           _allocate_memory=allocate)  # fmt: skip


def _seen(adjust, stub, steps: list[int], freqs: torch.Tensor) -> list[torch.Tensor]:
    """The queries and keys attention gets at each step of a static-cache run (prefill, then
    decode)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    ctx = StaticInferenceContext(2, sum(steps))
    gen = torch.Generator().manual_seed(1)
    seen = []
    for n in steps:
        q, k, v = (torch.randn(n, 2, 2, 16, generator=gen) for _ in range(3))
        query, key, _, emb, _, _ = adjust(stub, ctx, q, k, v, (freqs, freqs))
        if emb is not None:  # what Megatron's attention then does with the embeddings
            query, key = (apply_rotary_pos_emb(x, e, config=stub.config, cp_group=object())
                          for x, e in zip((query, key), emb, strict=True))  # fmt: skip
        seen += [query.clone(), key.clone()]
        ctx.sequence_len_offset += n
    return seen


def test_static_cache_rotated_at_store_equals_megatrons_rerotation(applied) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.attention import Attention

    from anyspeed.features.inference.feature import _store_rotated_keys

    current = Attention._adjust_key_value_for_inference
    megatron = getattr(current, "__wrapped__", current)
    assert megatron is not current  # the feature is applied
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                               apply_rope_fusion=True)  # fmt: skip
    freqs = RotaryEmbedding(16, rotary_percent=1.0, use_cpu_initialization=True)(12)
    steps = [5, 1, 1, 1]
    ref = _seen(megatron, _attention_stub(config, 2), steps, freqs)
    got = _seen(_store_rotated_keys(megatron), _attention_stub(config, 2), steps, freqs)
    assert [x.shape[0] for x in got] == [5, 5, 1, 6, 1, 7, 1, 8]
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
