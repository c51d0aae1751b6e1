"""``anyspeed pretrain``'s one flag path: published launch scripts parse, the flag table and the
presets describe the same models, and the module entry points work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from anyspeed.models import PRESETS, get_preset
from anyspeed.models.presets import model_from_args
from anyspeed.stages.arguments import parse_pretrain_args

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
    model = model_from_args(args)
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
    got = model_from_args(args)
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


# A complete, valid command line (mock data: nothing to read) for the range checks below.
MOCK = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3"]  # fmt: skip


def _with(flag: str, value: str) -> list[str]:
    argv = list(MOCK)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
        return argv
    return argv + [flag, value]


def test_every_numeric_flag_has_a_range():
    """The range table covers each flag a stage's parser reads as a number (pretraining's and
    every post-training stage's), and names no other."""
    from anyspeed.stages.ranges import RANGES
    from anyspeed.stages.table import STAGES, build_stage_parser

    numeric = {a.option_strings[0] for row in STAGES.values()
               for a in build_stage_parser(row())._actions
               if a.option_strings and a.type not in (None, str)}  # fmt: skip
    assert numeric == set(RANGES)


def _outside(rng) -> str:
    """A value just outside ``rng``: below its lower bound, else above its upper one (for an
    unbounded flag, a number that is not finite)."""
    if (rng.ge, rng.gt, rng.le, rng.lt) == (None, None, None, None):
        return "nan"
    if rng.ge is not None:
        return str(rng.ge - 1 if float(rng.ge).is_integer() else rng.ge - 0.5)
    if rng.gt is not None:
        return str(rng.gt)
    return str(rng.le + 1 if rng.le is not None else rng.lt)


def _inside(rng) -> str:
    if (rng.ge, rng.gt, rng.le, rng.lt) == (None, None, None, None):
        return "1.0"
    return str(rng.ge if rng.ge is not None else rng.gt + 0.5 if rng.le is None else rng.le)


def _range_rows():
    from anyspeed.stages.ranges import RANGES

    return sorted(RANGES.items())


@pytest.mark.parametrize(("flag", "rng"), _range_rows(), ids=[f for f, _ in _range_rows()])
def test_a_value_out_of_range_is_one_line_naming_the_flag(flag, rng):
    from anyspeed.errors import UsageError

    bad, parser = _outside(rng), _parser_for(flag)
    with pytest.raises(UsageError) as info:
        parse_pretrain_args(_with(flag, bad), parser)
    text = str(info.value)
    # a flag that is another's alias (--mini-batch-size for --global-batch-size) is named as it
    dest = parser._option_string_actions[flag].dest
    names = [f for a in parser._actions if a.dest == dest for f in a.option_strings[:1]]
    named = next((n for n in names if text.startswith(f"{n} ")), flag)
    assert "\n" not in text and named in text and bad.rstrip("0").rstrip(".") in text, text
    if flag != "--optimization-level":  # its own type says 0, 1 or 2
        assert text.startswith(f"{named} must be ")
    parse_pretrain_args(_with(flag, _inside(rng)), _parser_for(flag))  # the bound is accepted


def _parser_for(flag: str):
    """Pretraining's parser, or the first post-training stage's that has ``flag``."""
    from anyspeed.stages.arguments import build_parser
    from anyspeed.stages.table import STAGES, build_stage_parser

    for row in (None, *STAGES.values()):
        parser = build_parser() if row is None else build_stage_parser(row())
        if flag in parser._option_string_actions:
            return parser
    raise AssertionError(f"no stage has {flag}")


@pytest.mark.parametrize(("flag", "value", "line"), [
    ("--micro-batch-size", "0", "--micro-batch-size must be >= 1 (got 0)"),
    ("--micro-batch-size", "-2", "--micro-batch-size must be >= 1 (got -2)"),
    ("--global-batch-size", "0", "--global-batch-size must be >= 1 (got 0)"),
    ("--lr", "-1", "--lr must be >= 0 (got -1)"),
    ("--lr", "nan", "--lr must be a finite number (got nan)"),
    ("--log-interval", "0", "--log-interval must be >= 1 (got 0)"),
    ("--eval-interval", "0", "--eval-interval must be >= 1 (got 0)"),
    ("--num-layers", "0", "--num-layers must be >= 1 (got 0)"),
    ("--seq-length", "0", "--seq-length must be >= 1 (got 0)"),  # was a SIGFPE, no message
    ("--split", "0,0,0", "--split '0,0,0': the weights must be >= 0 and not all zero"),
    ("--split", "1,-1,0", "--split '1,-1,0': the weights must be >= 0 and not all zero"),
    ("--split", "a,b", "--split 'a,b': give up to three weights"),
])  # fmt: skip
def test_issue_numbers_stop_before_anything_starts(capsys, flag, value, line):
    """The issue's command lines, each once a traceback (or a silent SIGFPE): exit 2 with one
    line, in the process that parses, before any process group or model exists."""
    from anyspeed.commands.train import pretrain as main

    assert main(_with(flag, value) + ["--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"anyspeed pretrain: error: {line}"), err


def test_megatron_timeout_flag_is_accepted():
    args = parse_pretrain_args(MOCK + ["--distributed-timeout-minutes", "0.1"])
    assert args.distributed_timeout_minutes == 0.1
    assert parse_pretrain_args(MOCK).distributed_timeout_minutes == 10.0


def test_a_misspelled_flag_names_the_closest_one():
    from anyspeed.errors import UsageError

    with pytest.raises(UsageError, match="--micro-batch-sise: .*did you mean --micro-batch-size"):
        parse_pretrain_args(MOCK + ["--micro-batch-sise", "2"])


@pytest.mark.parametrize("weights", [["-1", "1"], ["0", "0"], ["nan", "1"]])
def test_data_path_weights_must_be_a_blend(weights):
    """A negative, NaN or all-zero blend weight reached Megatron's assertions (a traceback)."""
    import argparse

    from anyspeed.errors import UsageError
    from anyspeed.stages.common.gpt_data import data_blend

    path = [weights[0], "a", weights[1], "b"]
    with pytest.raises(UsageError, match=r"^--data-path: the weights .* must be >= 0 and not all"):
        data_blend(argparse.Namespace(data_path=path))
    assert data_blend(argparse.Namespace(data_path=["0", "a", "2", "b"])) == (["a", "b"], [0, 2])


def test_expert_bias_update_rate_reaches_megatron():
    """``--moe-router-bias-update-rate`` (Megatron's flag) sets the step of the aux-loss-free
    bias update in Megatron's config; without it Megatron's default 1e-3 holds."""
    from anyspeed.models import gpt

    base = ["--model", "tiny-qwen3-moe", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias"]  # fmt: skip
    for extra, want in (([], 1e-3), (["--moe-router-bias-update-rate", "0.05"], 0.05)):
        model = model_from_args(parse_pretrain_args(base + extra))
        assert gpt.transformer_config(model).moe_router_bias_update_rate == want
