"""MindSpeed-LLM's Gemma 2 spelling (``examples/mcore/gemma2/pretrain_gemma2_9b_ptd.sh``'s
model flags, sizes scaled down): it builds the model anyspeed reads from transformers'
``Gemma2Config`` of the same sizes (whose logits the conversion tests check against
transformers); the family is inferred from the flags (so an HF export is Gemma 2); its chat
template renders as MindSpeed-LLM's ``configs/finetune/templates.json`` defines it; what
contradicts or cannot run is one line."""

from __future__ import annotations

import pytest
from test_moe_flags import assert_rewritten_once, check_args

from anyspeed.errors import UsageError
from anyspeed.stages.arguments import parse_pretrain_args

RUN = "--mock-data --seq-length 64 --train-iters 2 --lr 1e-3 --global-batch-size 8 " \
      "--micro-batch-size 2".split()  # fmt: skip
# The script's GPT_ARGS model flags as written but the sizes (and --attn-logit-softcapping,
# which its generate script passes and its training scripts leave out).
SCRIPT = """
--spec mindspeed_llm.tasks.models.spec.gemma2_spec layer_spec --use-mcore-models
--use-fused-rmsnorm --use-fused-rotary-pos-emb --gelu-tanh --post-norm
--query-pre-attn-scalar 24 --output-logit-softcapping 30.0 --attn-logit-softcapping 50.0
--interleave-sliding-window 4 --num-layers 4 --hidden-size 64 --ffn-hidden-size 176
--num-attention-heads 4 --max-position-embeddings 256 --kv-channels 32 --group-query-attention
--num-query-groups 2 --make-vocab-size-divisible-by 1 --disable-bias-linear
--position-embedding-type rope --normalization RMSNorm --add-rmsnorm-offset --norm-epsilon 1e-06
--input-embeds-norm --use-flash-attn --no-masked-softmax-fusion --attention-softmax-in-fp32
--tokenizer-padding-side left --vocab-size 512 --no-gradient-accumulation-fusion
""".split()


def _model(*flags: str):
    return check_args(parse_pretrain_args([*flags, *RUN]), 1).model


def test_the_script_spelling_builds_transformers_gemma2():
    from transformers import Gemma2Config

    from anyspeed.models.hf import preset_from_hf

    hf = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=256, query_pre_attn_scalar=24, sliding_window=4,
                      rope_theta=10000.0)  # fmt: skip
    want = preset_from_hf({**hf.to_dict(), "architectures": ["Gemma2ForCausalLM"]})
    got = _model(*SCRIPT)
    assert got.same_architecture(want) == ["name"]
    assert got.family == "gemma2"  # inferred from the flags
    assert got.window_layers() == [True, False, True, False]  # layers 1 and 3 (of 1..4)


def test_the_spelling_is_rewritten_once():
    assert_rewritten_once([*SCRIPT, *RUN])


def test_the_gemma_template_renders_as_mindspeed_llm_defines_it():
    """``format_prefix`` bos, ``format_user``, the answer then ``format_separator``."""
    from anyspeed.data.templates import TEMPLATES

    turns = [("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"), ("assistant", "Ciao")]
    talk = [{"role": r, "content": c} for r, c in turns]
    user = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
    assert TEMPLATES["gemma"].segments(talk) == [
        ("<bos>" + user.format("Hi"), False, False),
        ("Hello<end_of_turn>\n", True, False),
        (user.format("Bye"), False, False),
        ("Ciao<end_of_turn>\n", True, False),
    ]


BASE = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 512".split()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("--interleave-sliding-window 4 --window-size 7",
         "--interleave-sliding-window 4 and --window-size 7 differ"),
        ("--interleave-sliding-window 4 --window-attn-skip-freq 3",
         "--interleave-sliding-window windows every other layer"),
        ("--interleave-sliding-window 0", "--interleave-sliding-window must be >= 1"),
        ("--gelu-tanh --swiglu", "--swiglu, --quick-geglu and --gelu-tanh are three activations"),
        ("--attn-logit-softcapping 0", "--attn-logit-softcapping must be > 0"),
        ("--attn-logit-softcapping 50 --context-parallel-size 2",
         "--attn-logit-softcapping (Gemma 2) does not run with --context-parallel-size 2"),
    ],
)  # fmt: skip
def test_what_contradicts_is_one_line(flags, words):
    with pytest.raises(UsageError) as err:
        check_args(parse_pretrain_args([*BASE, *flags.split(), *RUN]), 2)
    assert words in str(err.value) and "\n" not in str(err.value)
