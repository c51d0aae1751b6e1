"""MindSpeed-LLM's Qwen3-Next spelling (``examples/mcore/qwen3_next/tune_qwen3_next_80b_16K_full_
ptd.sh``'s model flags, sizes scaled down): it builds the model anyspeed reads from transformers'
``Qwen3NextConfig`` of the same sizes (whose logits the conversion tests check against
transformers), its router flags route as MindSpeed-LLM's formula does, and what contradicts or
cannot build is one line."""

from __future__ import annotations

import pytest
import torch
from test_moe_flags import assert_rewritten_once, check_args

from anyspeed.errors import UsageError
from anyspeed.stages.arguments import parse_pretrain_args

RUN = "--mock-data --seq-length 64 --train-iters 2 --lr 1e-3 --global-batch-size 8 " \
      "--micro-batch-size 2".split()  # fmt: skip
# The recipe's MOE_ARGS, OPTIMIZE_ARGS' model switches and GPT_ARGS, as written but the sizes.
RECIPE = """
--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--n-shared-experts 1 --shared-expert-gate --moe-alltoall-overlap-comm --moe-ffn-hidden-size 32
--moe-grouped-gemm --moe-permutation-async-comm --moe-token-dispatcher-type alltoall_seq
--moe-layer-freq 1 --norm-topk-prob --moe-aux-loss-coeff 0.001 --topk-softmax-in-fp32
--moe-router-pre-softmax --use-flash-attn --use-fused-rotary-pos-emb
--use-rotary-position-embeddings --use-fused-swiglu --no-masked-softmax-fusion --use-mcore-models
--spec mindspeed_llm.tasks.models.spec.qwen3_next_spec layer_spec --qk-layernorm
--full-attention-interval 4 --mamba-d-conv 4 --mamba-expand 1 --kv-channels 32
--linear-key-head-dim 16 --linear-num-key-heads 2 --linear-num-value-heads 4
--linear-value-head-dim 16 --partial-rotary-factor 0.25 --max-position-embeddings 256
--num-layers 4 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4
--make-vocab-size-divisible-by 1 --padded-vocab-size 512 --rotary-base 10000
--untie-embeddings-and-output-weights --disable-bias-linear --position-embedding-type rope
--normalization RMSNorm --no-enable-linear-qkv --swiglu --rmsnorm-weight-in-fp32
--add-rmsnorm-offset --attention-softmax-in-fp32 --no-gradient-accumulation-fusion
--group-query-attention --num-query-groups 2 --norm-epsilon 1e-06 --mamba-chunk-size 64
--use-triton-gdn --loss-compute-mode default --loss-chunk-size 1024
""".split()


def hf_sizes() -> dict:
    """transformers' Qwen3NextConfig of the recipe's (scaled) sizes."""
    return dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, shared_expert_intermediate_size=32, num_hidden_layers=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, max_position_embeddings=256, rope_theta=10000.0,
                rms_norm_eps=1e-6)  # fmt: skip


def _model(*flags: str):
    return check_args(parse_pretrain_args([*flags, *RUN]), 1).model


def test_the_recipe_spelling_builds_transformers_qwen3_next():
    from transformers import Qwen3NextConfig

    from anyspeed.models.hf import preset_from_hf

    want = preset_from_hf(Qwen3NextConfig(**hf_sizes()).to_dict())
    got = _model(*RECIPE)
    assert got.same_architecture(want) == ["name"]
    assert got.linear_attention_layers() == [True, True, True, False]
    assert got.moe_router_dtype == "fp32"  # --topk-softmax-in-fp32


def test_the_spelling_is_rewritten_once():
    assert_rewritten_once([*RECIPE, *RUN])


def test_renormalised_pre_softmax_top_k_is_megatrons_softmax_after_top_k():
    """MindSpeed-LLM's aux_loss router with --moe-router-pre-softmax --norm-topk-prob: softmax
    over every expert, top-k, renormalised (plain torch here). Megatron's router with the
    rewritten flag (softmax after top-k) gives the same experts and weights."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    scores, experts = torch.softmax(logits, dim=-1).topk(3, dim=-1)
    want = torch.zeros_like(logits).scatter(1, experts, scores / scores.sum(-1, keepdim=True))
    pre = _model(*"--num-experts 8 --moe-router-topk 3 --moe-router-pre-softmax --norm-topk-prob "
                 "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 512"
                 .split()).moe_router_pre_softmax  # fmt: skip
    assert pre is False
    probs, routing = topk_routing_with_score_function(logits, 3, use_pre_softmax=pre)
    assert torch.equal(routing, want > 0)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=1e-7)
    # without the rewrite Megatron's pre-softmax weights differ: the rule is needed
    probs, _ = topk_routing_with_score_function(logits, 3, use_pre_softmax=True)
    assert (probs - want).abs().max() > 1e-2


BASE = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 512".split()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("--no-enable-linear-qkv", "--no-enable-linear-qkv leaves attention without projections"),
        ("--mamba-d-conv 4", "--mamba-d-conv sizes gated DeltaNet layers here"),
        ("--full-attention-interval 4 --linear-attention-freq 2",
         "--full-attention-interval 4 and --linear-attention-freq 2 differ"),
        ("--full-attention-interval 4 --experimental-attention-variant dsa",
         "--full-attention-interval and --experimental-attention-variant dsa contradict"),
        ("--partial-rotary-factor 0.25 --rotary-percent 0.5",
         "--partial-rotary-factor 0.25 and --rotary-percent 0.5 differ"),
        ("--loss-compute-mode chunk", "--loss-compute-mode chunk"),
        ("--full-attention-interval 0 --mamba-d-conv 4", "--mamba-d-conv sizes"),
    ],
)  # fmt: skip
def test_what_contradicts_is_one_line(flags, words):
    with pytest.raises(UsageError) as err:
        _model(*BASE, *flags.split())
    assert words in str(err.value) and "\n" not in str(err.value)
