"""MindSpeed-LLM's inference scripts carry over: ``generate_qwen3_moe_30b_a3b_ptd.sh``,
``generate_gemma2_9b_ptd.sh``, ``generate_phi35_mini_ptd.sh`` and
``evaluate_qwen3_*_ptd.sh`` describe the model again (its spelling too: ``--first-k-dense-replace
-1 --moe-layer-freq -1 --norm-topk-prob``) and pass training switches. ``anyspeed generate``
takes them: the architecture values are checked against the checkpoint, the rest set aside in
one note, and the text is the same as without them. A value the checkpoint contradicts is one
line; a flag nobody knows still is."""

from __future__ import annotations

import os
import shutil

import pytest

from anyspeed.commands import generate
from helpers.convert_ranks import tiny_hf_model

# generate_qwen3_30b_a3b_ptd.sh's flags as written, sizes those of tiny-qwen3-moe
SCRIPT = """
--use-mcore-models --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec
--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-grouped-gemm
--moe-permutation-async-comm --moe-token-dispatcher-type alltoall_seq --first-k-dense-replace -1
--moe-layer-freq -1 --norm-topk-prob --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 0.001 --expert-model-parallel-size 1 --num-layers 2 --hidden-size 64
--ffn-hidden-size 176 --num-attention-heads 4 --kv-channels 32 --qk-layernorm
--group-query-attention --num-query-groups 2 --max-position-embeddings 4096 --seq-length 4096
--padded-vocab-size 512 --make-vocab-size-divisible-by 1 --rotary-base 1000000
--untie-embeddings-and-output-weights --disable-bias-linear --position-embedding-type rope
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --use-rotary-position-embeddings
--attention-softmax-in-fp32 --no-gradient-accumulation-fusion --no-masked-softmax-fusion
--use-fused-rmsnorm --use-fused-swiglu --micro-batch-size 1 --tokenizer-type PretrainedFromHF
--tokenizer-not-use-fast --hidden-dropout 0 --attention-dropout 0 --exit-on-missing-checkpoint
--transformer-impl local --ckpt-format torch --bf16
""".split()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, hf_tok: str) -> str:
    d = tmp_path_factory.mktemp("ms_generate") / "hf"
    tiny_hf_model(d, "tiny-qwen3-moe", seed=2, vocab_size=512)
    for name in os.listdir(hf_tok):
        shutil.copy(os.path.join(hf_tok, name), d / name)
    return str(d)


def _generate(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = generate.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_script_generates_the_same_text(capsys, moe_dir):
    base = ["--load", moe_dir, "--prompt", "the quick brown fox", "--max-new-tokens", "8",
            "--bf16"]  # fmt: skip
    rc, want, _ = _generate(capsys, base)
    assert rc == 0
    rc, got, err = _generate(capsys, [*base, *SCRIPT])
    assert rc == 0, err
    assert got[got.index("prompt:") :] == want[want.index("prompt:") :]  # after the conversion
    assert "note: training flags set aside" in err and "--use-mcore-models --spec" in err
    assert "--first-k-dense-replace" not in err  # it describes the model: checked
    assert all(line.startswith("anyspeed") for line in err.splitlines()), err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("--num-layers 3", "--num-layers 3 does not match the checkpoint (2)"),
        ("--add-qkv-bias", "--add-qkv-bias given does not match the checkpoint (False)"),
        ("--first-k-dense-replace 1", "--moe-layer-freq [0]*1+[1]*1 does not match"),
        ("--n-shared-experts 1 --moe-ffn-hidden-size 32",
         "--moe-shared-expert-intermediate-size 32 does not match"),
        ("--no-such-flag", "unsupported flag --no-such-flag"),
        ("--micro-batch-size x", "--micro-batch-size"),
    ],
)  # fmt: skip
def test_what_the_checkpoint_contradicts_is_one_line(capsys, moe_dir, flags, words):
    argv = ["--load", moe_dir, "--prompt", "hi", "--num-layers", "2", *flags.split()]
    rc, _, err = _generate(capsys, argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert words in err, err


def test_evaluate_prompt_type_renders_the_built_in_template(hf_tok):
    """``evaluate --prompt-type`` (MindSpeed-LLM's ling evaluation script passes it): each
    prompt is a user turn of the built-in template (ChatML written out here by hand)."""
    from argparse import Namespace

    from anyspeed.commands.eval_tasks import _wrap
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer

    tok = load_tokenizer(TokenizerSpec(name_or_path=hf_tok))
    args = Namespace(use_chat=True, prompt_type="chatml")
    want = "<|im_start|>user\nWhich is larger?<|im_end|>\n<|im_start|>assistant\n"
    assert _wrap(args, tok, ["Which is larger?"]) == tok.encode([want], special=False)
    plain = Namespace(use_chat=False, prompt_type="chatml")  # likelihood reads: no template
    assert _wrap(plain, tok, ["Which is larger?"]) == tok.encode(["Which is larger?"], special=True)


# generate_gemma2_9b_ptd.sh's flags as written, sizes those of tiny-gemma2
GEMMA2_SCRIPT = """
--spec mindspeed_llm.tasks.models.spec.gemma2_spec layer_spec --use-mcore-models --gelu-tanh
--post-norm --query-pre-attn-scalar 24 --output-logit-softcapping 3.0 --interleave-sliding-window 4
--attn-logit-softcapping 2.0 --num-layers 3 --hidden-size 64 --ffn-hidden-size 176
--num-attention-heads 4 --kv-channels 32 --group-query-attention --num-query-groups 2
--max-position-embeddings 8192 --seq-length 8192 --make-vocab-size-divisible-by 1
--disable-bias-linear --position-embedding-type rope --normalization RMSNorm
--add-rmsnorm-offset --norm-epsilon 1e-06 --input-embeds-norm --attention-softmax-in-fp32
--no-gradient-accumulation-fusion --no-masked-softmax-fusion --micro-batch-size 1
--tokenizer-type PretrainedFromHF --tokenizer-not-use-fast --hidden-dropout 0
--attention-dropout 0 --exit-on-missing-checkpoint --transformer-impl local --ckpt-format torch
--vocab-size 512 --seed 42
""".split()


def _script_gives_the_same_text(capsys, d, hf_tok, preset: str, script: list[str], **kw) -> list:
    """A tiny random ``preset`` model in ``d`` generates the same text with ``script``'s
    flags as without them; the base command line, for a contradicting variant."""
    tiny_hf_model(d, preset, seed=2, **kw)
    for name in os.listdir(hf_tok):
        shutil.copy(os.path.join(hf_tok, name), d / name)
    base = ["--load", str(d), "--prompt", "the quick brown fox", "--max-new-tokens", "8"]
    rc, want, _ = _generate(capsys, base)
    assert rc == 0
    rc, got, err = _generate(capsys, [*base, *script])
    assert rc == 0, err
    assert got[got.index("prompt:") :] == want[want.index("prompt:") :]
    return base


def test_the_gemma2_script_generates_the_same_text(capsys, tmp_path, hf_tok):
    base = _script_gives_the_same_text(capsys, tmp_path / "hf", hf_tok, "tiny-gemma2",
                                       GEMMA2_SCRIPT, vocab_size=512)  # fmt: skip
    rc, _, err = _generate(capsys, [*base, *GEMMA2_SCRIPT, "--interleave-sliding-window", "8"])
    assert rc == 2 and "--window-size 7 does not match the checkpoint (3)" in err, err


# generate_phi35_mini_ptd.sh's flags as written, sizes (and LongRoPE factors) those of tiny-phi3
PHI35_SCRIPT = """
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-mcore-models
--use-flash-attn --rope-scaling-type longrope --longrope-freqs-type outer
--rope-scaling-original-max-position-embeddings 16 --num-layers 3 --hidden-size 64
--ffn-hidden-size 176 --num-attention-heads 4 --group-query-attention --num-query-groups 2
--position-embedding-type rope --no-rope-fusion --swiglu --seq-length 64
--max-position-embeddings 64 --max-new-tokens 8 --micro-batch-size 1
--tokenizer-type PretrainedFromHF --tokenizer-not-use-fast --normalization RMSNorm
--norm-epsilon 1e-05 --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0
--rotary-base 10000 --rotary-percent 0.75 --untie-embeddings-and-output-weights
--attention-softmax-in-fp32 --no-load-optim --no-load-rng --no-masked-softmax-fusion
--no-gradient-accumulation-fusion --exit-on-missing-checkpoint --make-vocab-size-divisible-by 1
--padded-vocab-size 512 --seed 42 --long-factor 1.5,2.0,4.0,8.0,16.0,32.0
--short-factor 1.0,1.1,1.25,1.5,2.0,3.0 --transformer-impl local --ckpt-format torch
""".split()


def test_the_phi35_script_generates_the_same_text(capsys, tmp_path, hf_tok):
    base = _script_gives_the_same_text(capsys, tmp_path / "hf", hf_tok, "tiny-phi3", PHI35_SCRIPT)
    other = [*base, *PHI35_SCRIPT, "--long-factor", "1,1,1,1,1,1"]
    rc, _, err = _generate(capsys, other)
    assert rc == 2 and "--long-factor (1.0, 1.0, 1.0, 1.0, 1.0, 1.0) does not match" in err, err
