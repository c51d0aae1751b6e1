"""MindSpeed-LLM's Phi-3.5 spelling (``examples/mcore/phi35/pretrain_phi35_mini_A3_ptd.sh``'s
model flags, sizes scaled down): it builds the model anyspeed reads from transformers'
``Phi3Config`` of the same sizes and LongRoPE (whose logits the conversion tests check against
transformers); the family is inferred from the flags (an HF export is Phi-3); the preset's
factors are the script's; what contradicts or cannot run is one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_moe_flags import assert_rewritten_once, check_args

from anyspeed.errors import UsageError
from anyspeed.stages.arguments import parse_pretrain_args

RUN = "--mock-data --seq-length 64 --train-iters 2 --lr 1e-3 --global-batch-size 8 " \
      "--micro-batch-size 2".split()  # fmt: skip
SHORT, LONG = "1.0,1.1,1.2,1.4,1.8,2.0,2.5,3.0", "1.5,2.0,3.0,5.0,8.0,16.0,32.0,64.0"
# The script's GPT_ARGS model flags as written but the sizes (head 16 -> 8 factors).
SCRIPT = f"""
--use-mcore-models --rope-scaling-type longrope --longrope-freqs-type outer
--rope-scaling-original-max-position-embeddings 32 --use-fused-rmsnorm --use-fused-rotary-pos-emb
--use-fused-swiglu --swiglu --num-layers 2 --hidden-size 64 --ffn-hidden-size 176
--num-attention-heads 4 --max-position-embeddings 256 --make-vocab-size-divisible-by 1
--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --position-embedding-type rope
--normalization RMSNorm --norm-epsilon 1e-5 --use-flash-attn --rotary-base 10000
--no-masked-softmax-fusion --attention-softmax-in-fp32 --padded-vocab-size 512
--untie-embeddings-and-output-weights --model-type-hf phi3.5 --long-factor {LONG}
--short-factor {SHORT} --transformer-impl local
""".split()
MIRROR = Path("/work/.mirror/Ascend+MindSpeed-LLM/repo")


def _model(*flags: str):
    return check_args(parse_pretrain_args([*flags, *RUN]), 1).model


def test_the_script_spelling_builds_transformers_phi3():
    from transformers import Phi3Config

    from anyspeed.models.hf import preset_from_hf

    rope = {"rope_type": "longrope", "short_factor": [float(x) for x in SHORT.split(",")],
            "long_factor": [float(x) for x in LONG.split(",")]}  # fmt: skip
    hf = Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=256,
                    original_max_position_embeddings=32, rope_scaling=rope)  # fmt: skip
    want = preset_from_hf({**hf.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    got = _model(*SCRIPT)
    assert got.same_architecture(want) == ["name"]
    assert got.family == "phi3"  # inferred from the flags


def test_both_frequency_spellings_are_one_model():
    mul = [f if f != "outer" else "mul" for f in SCRIPT]
    assert _model(*SCRIPT).same_architecture(_model(*mul)) == []


def test_the_spelling_is_rewritten_once():
    assert_rewritten_once([*SCRIPT, *RUN])


def test_the_model_flags_round_trip():
    """``megatron_args`` (what checkpoints and presets hand on) parse back to the model."""
    model = _model(*SCRIPT)
    assert _model(*model.megatron_args()).same_architecture(model) == []


def _script_factors(name: str) -> tuple[float, ...]:
    script = MIRROR / "examples/mcore/phi35/pretrain_phi35_mini_A3_ptd.sh"
    text = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{script.relative_to(MIRROR)}"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    line = next(x for x in text.splitlines() if x.startswith(f"{name}="))
    return tuple(float(v) for v in line.split("=", 1)[1].strip('"').split(","))


@pytest.mark.skipif(not MIRROR.exists(), reason="MindSpeed-LLM is not fetched here")
def test_the_preset_factors_are_the_scripts():
    from anyspeed.models.presets import PRESETS

    preset = PRESETS["phi3.5-mini"]
    assert preset.longrope_long_factor == _script_factors("LONG_FACTOR")
    assert preset.longrope_short_factor == _script_factors("SHORT_FACTOR")


BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 512".split()
LR = f"--rope-scaling-type longrope --long-factor {LONG} --short-factor {SHORT}"


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (f"--long-factor {LONG}", "--long-factor is LongRoPE's: add --rope-scaling-type longrope"),
        (f"{LR}", "--rope-scaling-type longrope needs --short-factor, --long-factor and "
                  "--rope-scaling-original-max-position-embeddings"),
        (f"{LR} --rope-scaling-original-max-position-embeddings 32 --rotary-percent 0.5",
         "--short-factor has 8 numbers; the 8 rotary channels of each head need 4"),
        (f"{LR} --rope-scaling-original-max-position-embeddings 32 --long-mscale 1.2 "
         "--short-mscale 1.1", "--long-mscale: an attention factor per LongRoPE set"),
        (f"{LR} --rope-scaling-original-max-position-embeddings 32 --use-rope-scaling",
         "--rope-scaling-type longrope scales plain RoPE"),
    ],
)  # fmt: skip
def test_what_contradicts_is_one_line(flags, words):
    with pytest.raises(UsageError) as err:
        check_args(parse_pretrain_args([*BASE, *flags.split(), *RUN]), 1)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_an_unreadable_factor_list_is_one_line():
    with pytest.raises(UsageError, match="--long-factor: cannot read '1,x'"):
        parse_pretrain_args([*BASE, *"--rope-scaling-type longrope --long-factor 1,x".split()])


def test_megatron_lm_training_loop_refuses_longrope():
    import argparse

    from anyspeed.features.base import FeatureError
    from anyspeed.features.compat.rope_scaling_flags import refuse_longrope_in_megatron_lm

    with pytest.raises(FeatureError, match="runs in `anyspeed pretrain`"):
        refuse_longrope_in_megatron_lm(argparse.Namespace(rope_scaling_type="longrope"))


def test_a_window_at_cp2_is_one_line():
    """Phi-3's 4k models have a window; the context-parallel attention core has none."""
    argv = ["--model", "tiny-phi3", "--context-parallel-size", "2", *RUN]
    with pytest.raises(UsageError) as err:
        check_args(parse_pretrain_args(argv), 2)
    words = "--window-size (sliding-window attention) does not run with --context-parallel-size 2"
    assert words in str(err.value) and "\n" not in str(err.value)
