"""``anyspeed pretrain``'s one flag path: published launch scripts parse, the flag table and the
presets describe the same models, and the module entry points work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from anyspeed.models import PRESETS, ModelConfig, get_preset
from anyspeed.training.arguments import parse_pretrain_args

# MindSpeed-LLM v2.3.0 examples/mcore/qwen25/pretrain_qwen25_7b_32k_ptd.sh, every argument
# (paths replaced; the distributed launcher's own flags are torchrun's).
QWEN25_7B_SCRIPT = """
--use-mcore-models --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2
--sequence-parallel --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944
--num-attention-heads 28 --group-query-attention --num-query-groups 4 --disable-bias-linear
--add-qkv-bias --swiglu --normalization RMSNorm --norm-epsilon 1e-6
--position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights
--max-position-embeddings 32768 --seq-length 32768 --make-vocab-size-divisible-by 1
--padded-vocab-size 152064 --tokenizer-type PretrainedFromHF --tokenizer-name-or-path TOK
--use-flash-attn --use-fused-swiglu --use-fused-rmsnorm --use-fused-rotary-pos-emb
--no-gradient-accumulation-fusion --no-masked-softmax-fusion --attention-softmax-in-fp32 --bf16
--micro-batch-size 1 --global-batch-size 64 --train-iters 2000 --lr 1.25e-6
--lr-decay-style cosine --min-lr 1.25e-7 --lr-warmup-fraction 0.01 --init-method-std 0.01
--weight-decay 1e-1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
--initial-loss-scale 4096 --attention-dropout 0.0 --hidden-dropout 0.0 --data-path DATA
--split 100,0,0 --load CKPT --save CKPT --no-load-optim --no-load-rng --no-save-optim
--no-save-rng --seed 1234 --log-interval 1 --save-interval 2000 --eval-interval 2000
--eval-iters 0 --log-throughput --distributed-backend nccl
""".split()


def test_mindspeed_llm_qwen25_7b_script_parses():
    args = parse_pretrain_args(QWEN25_7B_SCRIPT)
    assert args.tensor_model_parallel_size == 4 and args.no_save_rng and args.bf16
    args.padded_vocab_size = 152064
    model = ModelConfig.from_args(args)
    want = get_preset("qwen2.5-7b")
    # The script is the published 7B architecture (its 32k run shortens the positions).
    assert model == want.replace(name=model.name, max_position_embeddings=32768)
    assert model.family == "qwen2" and model.init_method_std == 0.01


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_flags_describe_the_preset(name):
    """A preset's flags, through the pretraining parser, give back the preset: the flag table
    and the preset table agree."""
    args = parse_pretrain_args(["--model", name])
    assert args.model == name
    got = ModelConfig.from_args(args)
    want = get_preset(name)
    assert got == want
    assert got.rope_scaling == want.rope_scaling or (
        got.rope_scaling["factor"] == want.rope_scaling["factor"]
    )


def test_unknown_flag_is_one_line():
    from anyspeed.errors import UsageError

    with pytest.raises(UsageError, match="unsupported flag --no-such-flag"):
        parse_pretrain_args(["--no-such-flag"])


def test_python_dash_m_anyspeed():
    out = subprocess.run([sys.executable, "-m", "anyspeed", "--version"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("anyspeed ")
    out = subprocess.run([sys.executable, "-m", "anyspeed", "models"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "qwen2.5-7b" in out.stdout
