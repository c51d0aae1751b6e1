"""MoE flags before anything starts: MindSpeed-LLM's names build the same model as Megatron's,
and bad MoE settings are one line (in the launcher, before torchrun)."""

from __future__ import annotations

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.arguments import parse_pretrain_args
from anyspeed.stages.checks import check, complete, gpt_data_prefixes
from anyspeed.training.run import freeze


def check_args(args, world: int):
    """The checks ``anyspeed pretrain`` runs before start (complete, freeze, check)."""
    tok = complete(args)
    freeze(args)
    return check(args, world, gpt_data_prefixes(args), tok)


def assert_rewritten_once(argv: list[str]) -> None:
    """The checks run in the launcher and again on the same namespace: the second pass (which
    reads Megatron's flags only) changes nothing."""
    from anyspeed import features
    from anyspeed.device import detect

    args = parse_pretrain_args(argv)
    check_args(args, 1)
    before = dict(vars(args))
    features.validate(args, detect())
    assert dict(vars(args)) == before


RUN = ("--model tiny-qwen2.5 --mock-data --vocab-size 512 --seq-length 64 --train-iters 2 "
       "--lr 1e-3 --global-batch-size 8 --micro-batch-size 2 --num-experts 4 "
       "--moe-ffn-hidden-size 32").split()  # fmt: skip


def _model(*flags: str, world: int = 1):
    return check_args(parse_pretrain_args([*RUN, *flags]), world).model


@pytest.mark.parametrize(
    "mindspeed,megatron",
    [
        ("--n-shared-experts 2 --shared-expert-gate",
         "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate"),
        ("--first-k-dense-replace 1", "--moe-layer-freq [0]*1+[1]*1"),
        # MindSpeed-LLM's Qwen3-MoE recipes: -1 and -1, every layer MoE
        ("--first-k-dense-replace -1 --moe-layer-freq -1", "--moe-layer-freq 1"),
        # MindSpeed-LLM's rule: MoE when i >= K and i % freq == 0 (layer 2 of 0..3)
        ("--num-layers 4 --first-k-dense-replace 1 --moe-layer-freq 2",
         "--num-layers 4 --moe-layer-freq [0]*2+[1]*1+[0]*1"),
        ("--position-embedding-type learned_absolute --use-rotary-position-embeddings",
         "--position-embedding-type rope"),
        ("--moe-router-load-balancing-type softmax_topk",
         "--moe-router-pre-softmax --moe-router-load-balancing-type none"),
        ("--moe-router-load-balancing-type softmax_topk --norm-topk-prob",
         "--moe-router-load-balancing-type none"),
        ("--moe-router-load-balancing-type group_limited_greedy --moe-router-num-groups 2 "
         "--moe-router-group-topk 1 --seq-aux",
         "--moe-router-pre-softmax --moe-router-num-groups 2 --moe-router-group-topk 1 "
         "--moe-router-load-balancing-type seq_aux_loss"),
        ("--seq-aux --router-gating-in-fp32",
         "--moe-router-load-balancing-type seq_aux_loss --moe-router-dtype fp32"),
        ("--moe-token-dispatcher-type alltoall_seq", "--moe-token-dispatcher-type alltoall"),
        ("--rope-scaling-type yarn --rope-scaling-factor 40 --rope-scaling-mscale 0.707 "
         "--rope-scaling-mscale-all-dim 0.707 --rope-scaling-beta-fast 32",
         "--rope-type yarn --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707"),
    ],
)  # fmt: skip
def test_mindspeed_names_build_the_same_model(mindspeed, megatron):
    got, want = _model(*mindspeed.split()), _model(*megatron.split())
    # the MoE layers as a list (``1`` and ``[1]*2`` describe the same two layers)
    got, want = (m.replace(moe_layer_freq=str(m.moe_layers())) for m in (got, want))
    assert got.to_dict() == want.to_dict() or (
        # MindSpeed's dispatcher name stays visible in the model type; it builds as alltoall
        got.replace(moe_token_dispatcher_type="alltoall").to_dict() == want.to_dict()
    )


@pytest.mark.parametrize(
    "flags,line",
    [
        ("--moe-router-topk 5", "--moe-router-topk 5 exceeds --num-experts 4"),
        ("--moe-layer-freq [0]*1+[1]*2", "describes 3 layers; --num-layers is 2"),
        ("--moe-router-num-groups 3 --moe-router-group-topk 1", "--moe-router-num-groups"),
        ("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid"),
        ("--moe-shared-expert-gate", "needs --moe-shared-expert-intermediate-size"),
        ("--moe-token-dispatcher-type flex", "flex needs DeepEP or HybridEP on CUDA"),
        ("--moe-router-load-balancing-type group_limited_greedy", "needs --moe-router-num-groups"),
        ("--first-k-dense-replace 1 --moe-layer-freq [1]*2", "contradict: give one"),
        ("--first-k-dense-replace -2", "--first-k-dense-replace must be >= -1"),
        ("--moe-layer-freq 0", "--moe-layer-freq must not be 0"),
        ("--expert-model-parallel-size 3", "--num-experts 4 is not divisible by"),
        ("--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor"),
        ("--moe-expert-capacity-factor 0", "--moe-expert-capacity-factor must be > 0"),
        ("--rope-scaling-type yarn --rope-scaling-original-max-position-embeddings 8192",
         "Megatron-Core 0.16.1 fixes it to 4096"),
        ("--multi-latent-attention", "--multi-latent-attention needs --qk-layernorm"),
        ("--beta-fast 16", "--beta-fast 16: Megatron-Core 0.16.1 fixes it to 32"),
        ("--decoder-first-pipeline-num-layers 1", "need --pipeline-model-parallel-size >= 2"),
    ],
)  # fmt: skip
def test_bad_moe_settings_are_one_line(flags, line):
    with pytest.raises(UsageError, match=None) as err:
        _model(*flags.split(), world=3 if "parallel-size 3" in flags else 1)
    assert line in str(err.value) and "\n" not in str(err.value), err.value


def test_expert_parallel_needs_experts():
    args = parse_pretrain_args([a for a in RUN if a not in ("--num-experts", "4")] +
                               ["--expert-model-parallel-size", "2"])  # fmt: skip
    with pytest.raises(UsageError, match="need a MoE model: add --num-experts"):
        check_args(args, 2)


def test_grouped_gemm_without_experts_is_refused():
    """``--moe-grouped-gemm`` on a dense model used to be ignored (issue 43, item 11)."""
    args = parse_pretrain_args([a for a in RUN if a not in ("--num-experts", "4")] +
                               ["--moe-grouped-gemm"])  # fmt: skip
    with pytest.raises(UsageError, match="--moe-grouped-gemm needs a MoE model"):
        check_args(args, 1)


def test_grouped_experts_with_biases_are_refused():
    """Megatron's GroupedMLP has no biases (GPT-OSS's experts train through SequentialMLP):
    refused before start instead of an assertion per rank."""
    args = parse_pretrain_args([*RUN, "--num-layers", "2", "--hidden-size", "64",
                                "--num-attention-heads", "4", "--moe-grouped-gemm"])  # fmt: skip
    args.disable_bias_linear = False  # the preset turned biases off; Megatron's default is on
    with pytest.raises(UsageError, match="add --disable-bias-linear"):
        check_args(args, 1)


def test_latent_attention_with_context_parallel_is_one_line_before_start():
    """MLA has no context-parallel core: refused by the layout check, not by the built model."""
    with pytest.raises(UsageError) as err:
        _model("--multi-latent-attention", "--qk-layernorm", "--context-parallel-size", "2",
               world=2)  # fmt: skip
    assert "--context-parallel-size 2" in str(err.value) and "\n" not in str(err.value)


DSA_RUN = ["--model", "tiny-deepseek-v3", *RUN[2:-4]]  # RUN without its model and experts


def test_mindspeed_dsa_names_build_the_same_model():
    """MindSpeed-LLM's DeepSeek-V3.2 indexer flags (its loss coefficient defaulting to 1.0)."""

    def model(flags: str):
        args = parse_pretrain_args([*DSA_RUN, *flags.split()])
        return check_args(args, 1).model, args

    got, args = model("--enable-dsa-indexer --index-n-heads 8 --index-head-dim 16 --index-topk 6")
    want, _ = model(
        "--experimental-attention-variant dsa --dsa-indexer-n-heads 8 --dsa-indexer-head-dim 16 "
        "--dsa-indexer-topk 6 --dsa-indexer-loss-coeff 1"
    )
    assert got.to_dict() == want.to_dict() and got.experimental_attention_variant == "dsa"
    assert args.dsa_indexer_loss_coeff == 1.0
    for flags, line in (
        ("--index-topk 6", "--index-topk needs --enable-dsa-indexer"),
        ("--enable-dsa-indexer --index-topk 6 --dsa-indexer-topk 8", "differ"),
    ):
        with pytest.raises(UsageError, match=line):
            model(flags)


@pytest.mark.parametrize(
    ("flags", "granularity", "modules"),
    [
        ("--moe-zero-memory level0 --moe-grouped-gemm", "selective", ["moe_act"]),
        ("--moe-zero-memory level1", "selective", ["moe"]),
        ("--moe-zero-memory level0 --moe-grouped-gemm --recompute-granularity selective",
         "selective", ["core_attn", "moe_act"]),
        ("--moe-zero-memory level1 --recompute-granularity selective --recompute-modules mlp",
         "selective", ["mlp", "moe"]),
        ("--moe-zero-memory level0 --recompute-granularity full --recompute-method uniform "
         "--recompute-num-layers 1", "full", []),
        ("--moe-zero-memory disable", None, []),
    ],
)  # fmt: skip
def test_moe_zero_memory_is_megatrons_moe_recompute(flags, granularity, modules):
    """MindSpeed's --moe-zero-memory (recompute inside the MoE layer): level0 recomputes the
    experts' activation, level1 the MoE layer, added to the modules asked (Megatron's default
    core_attn kept); under full recompute it adds nothing."""
    args = parse_pretrain_args([*RUN, *flags.split()])
    check_args(args, 1)
    assert args.recompute_granularity == granularity
    assert list(args.recompute_modules or []) == modules


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("--moe-zero-memory level1 --moe-zero-memory-num-layers 1",
         "--moe-zero-memory-num-layers: Megatron's selective recompute covers every layer"),
        ("--moe-zero-memory-num-layers 1", "needs --moe-zero-memory level1"),
        ("--moe-zero-memory level0", "add --moe-grouped-gemm, or use level1"),
        ("--recompute-granularity selective --recompute-modules moe_act",
         "--recompute-modules moe_act needs --moe-grouped-gemm"),
    ],
)  # fmt: skip
def test_moe_zero_memory_layer_counts_are_one_line(flags, words):
    with pytest.raises(UsageError, match=words):
        check_args(parse_pretrain_args([*RUN, *flags.split()]), 1)
