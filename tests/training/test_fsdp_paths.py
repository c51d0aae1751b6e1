"""Megatron-Core's FSDP paths in ``anyspeed pretrain`` on every device: ``--use-torch-fsdp2``
(TorchFullyShardedDataParallel) and ``--use-megatron-fsdp`` (each sharding strategy that runs).
Loss and grad norm equal DDP with the distributed optimizer for 4 steps, at DP2 and TP2 (+SP) x
DP2; with FSDP2 each rank holds half of DDP's parameters, gradients and optimizer state
(measured on the ranks' own tensors), and its checkpoints resume and read across."""

from __future__ import annotations

import pytest
from test_pretrain import _close, base_args, write_corpus

from anyspeed.testing import run_distributed
from helpers import pretrain_ranks


def run_many(world: int, clis: list[list[str]], timeout: float = 600) -> list[dict]:
    """The command lines in turn on ``world`` fresh ranks: Megatron-FSDP's device meshes
    outlive a process group, so ranks that trained other layouts before fail its grad-norm
    check (each CLI run is a process of its own anyway)."""
    ranks = run_distributed(
        pretrain_ranks.pretrain_many, world, argv=clis[0], clis=clis, timeout=timeout, fresh=True
    )
    return ranks[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_corpus(str(tmp_path_factory.mktemp("fsdp2_corpus") / "c"))


def _args(corpus: str, *extra: str) -> list[str]:
    args = base_args(corpus, 4) + ["--untie-embeddings-and-output-weights", "--eval-iters", "0"]
    return [*args, *extra]


def test_dp2_equals_distributed_optimizer_and_halves_the_state(corpus: str) -> None:
    fsdp, distopt, ddp = run_many(
        2,
        [
            _args(corpus, "--use-torch-fsdp2"),
            _args(corpus, "--use-distributed-optimizer"),
            _args(corpus),
        ],
    )
    _close(fsdp["loss"], distopt["loss"])
    _close(fsdp["grad_norm"], distopt["grad_norm"])
    for key in ("params", "grads", "optimizer"):
        half = ddp["state_bytes"][key] / 2
        assert fsdp["state_bytes"][key] == pytest.approx(half, rel=0.02), key
        # anyspeed memory's figures for both layouts (ZeRO-3 for FSDP2, DDP's whole state)
        for run in (fsdp, ddp):
            assert run["estimate"][key] == pytest.approx(run["state_bytes"][key], rel=0.02), key


def test_megatron_fsdp_strategies_equal_distributed_optimizer(corpus: str) -> None:
    mfsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
    distopt, *runs = run_many(
        2,
        [
            _args(corpus, "--use-distributed-optimizer"),
            *(_args(corpus, *mfsdp, s) for s in ("optim", "optim_grads", "optim_grads_params")),
        ],
    )
    for run in runs:
        _close(run["loss"], distopt["loss"])
        _close(run["grad_norm"], distopt["grad_norm"])
    # what each strategy holds per rank, measured on Megatron-FSDP's own buffers, against
    # anyspeed memory (ZeRO-1: moments and masters sharded; 2: + gradients; 3: + parameters)
    for run in runs:
        for key in ("params", "grads", "optimizer"):
            assert run["estimate"][key] == pytest.approx(run["state_bytes"][key], rel=0.03), key
    zero1, zero2, zero3 = (r["state_bytes"] for r in runs)
    assert zero2["grads"] == pytest.approx(zero1["grads"] / 2, rel=0.03)
    assert zero3["params"] == pytest.approx(zero2["params"] / 2, rel=0.03)


@pytest.mark.slow
def test_tp2_sp_dp2_equals_distributed_optimizer(corpus: str) -> None:
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    distopt, *runs = run_many(
        4,
        [
            _args(corpus, *tp, "--use-distributed-optimizer"),
            _args(corpus, *tp, "--use-torch-fsdp2"),
            _args(corpus, *tp, "--use-megatron-fsdp"),
        ],
    )
    for run in runs:
        _close(run["loss"], distopt["loss"])
        _close(run["grad_norm"], distopt["grad_norm"])


def _hf_tensors(directory) -> dict:  # noqa: ANN001 - a path
    import glob

    from safetensors.torch import load_file

    out: dict = {}
    for f in glob.glob(f"{directory}/*.safetensors"):
        out.update(load_file(f))
    return out


def _same_hf_tensors(one: str, other: str) -> None:
    """Both checkpoints converted to HF by ``anyspeed convert`` hold the same tensors (1e-5)."""
    from anyspeed.commands.convert import main as convert

    for src in (one, other):
        argv = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", src,
                "--save-dir", src + "_hf"]  # fmt: skip
        assert convert(argv) == 0
    a, b = _hf_tensors(one + "_hf"), _hf_tensors(other + "_hf")
    assert set(a) == set(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_checkpoints_resume_and_read_across(corpus: str, tmp_path) -> None:
    """Saved at step 2 and resumed, FSDP2 equals the uninterrupted run; FSDP2 reads DDP's
    checkpoint and DDP reads FSDP2's (the same global tensors), and FSDP2's converts to HF as
    DDP's does."""
    fs, dd = str(tmp_path / "fsdp"), str(tmp_path / "ddp")
    stop = ["--save-interval", "2", "--exit-interval", "2"]
    whole, _, _, resumed, ddp_reads, fsdp_reads = run_many(
        2,
        [
            _args(corpus, "--use-torch-fsdp2"),
            _args(corpus, "--use-torch-fsdp2", "--save", fs, *stop),
            _args(corpus, "--save", dd, *stop),
            _args(corpus, "--use-torch-fsdp2", "--load", fs),
            _args(corpus, "--load", fs),
            _args(corpus, "--use-torch-fsdp2", "--load", dd),
        ],
    )
    for run in (resumed, ddp_reads, fsdp_reads):
        _close(run["loss"], whole["loss"][2:])
        _close(run["grad_norm"], whole["grad_norm"][2:])
    _same_hf_tensors(fs, dd)


def test_megatron_fsdp_checkpoints(corpus: str, tmp_path, capsys) -> None:
    """Megatron-FSDP saved at step 2 and resumed equals the uninterrupted run; its checkpoint
    converts to the HF tensors of the distributed optimizer's at the same step; it starts from
    a DDP checkpoint's weights (--finetune) as the distributed optimizer does; and what it does
    not do is one line (:func:`_refusals`). No run returns with a parameter all-gather in flight
    (Megatron-FSDP prefetches after every step; left pending into the next run's teardown of
    the groups, a rank once died of SIGSEGV in CI)."""
    mf, dd = str(tmp_path / "mfsdp"), str(tmp_path / "distopt")
    fsdp, opt = ["--use-megatron-fsdp"], ["--use-distributed-optimizer"]
    stop = ["--save-interval", "2", "--exit-interval", "2"]
    whole, _, resumed, _, from_ddp, distopt_from_ddp = run_many(
        2,
        [
            _args(corpus, *fsdp),
            _args(corpus, *fsdp, "--save", mf, *stop),
            _args(corpus, *fsdp, "--load", mf),
            _args(corpus, *opt, "--save", dd, *stop),
            _args(corpus, *fsdp, "--load", dd, "--finetune"),
            _args(corpus, *opt, "--load", dd, "--finetune"),
        ],
    )
    _close(resumed["loss"], whole["loss"][2:])
    _close(resumed["grad_norm"], whole["grad_norm"][2:])
    assert [r["pending_gathers"] for r in (whole, resumed, from_ddp)] == [0, 0, 0]
    _close(from_ddp["loss"], distopt_from_ddp["loss"])
    _close(from_ddp["grad_norm"], distopt_from_ddp["grad_norm"])
    _same_hf_tensors(mf, dd)
    _refusals(corpus, mf, dd, capsys)


def _refusals(corpus: str, mf: str, dd: str, capsys) -> None:
    """What Megatron-FSDP checkpoints do not do is one line before start: resume a DDP
    checkpoint (its weights: --finetune), be resumed without the flag or at another TP size,
    or run at one data-parallel rank."""
    from anyspeed.commands.train import pretrain

    cases = [
        (["--use-megatron-fsdp", "--load", dd], "starts from its weights with --finetune"),
        (["--load", mf], "resume it with --use-megatron-fsdp"),
        (["--use-megatron-fsdp", "--load", mf, "--tensor-model-parallel-size", "2"],
         "saved it at --tensor-model-parallel-size 1"),
    ]  # fmt: skip
    capsys.readouterr()
    for extra, says in cases:
        assert pretrain(["--nproc-per-node", "4", *_args(corpus, *extra)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert pretrain(["--nproc-per-node", "1", *_args(corpus, "--use-megatron-fsdp")]) == 2
    assert "one data-parallel rank" in capsys.readouterr().err


@pytest.mark.slow
def test_megatron_fsdp_resumes_at_another_dp(corpus: str, tmp_path) -> None:
    """Saved at DP2, resumed at DP4 (TP1) and TP2 x DP2 saved and resumed at that layout:
    equal to the uninterrupted runs."""
    mf, tp_mf = str(tmp_path / "mfsdp"), str(tmp_path / "tp_mfsdp")
    stop = ["--save-interval", "2", "--exit-interval", "2"]
    tp = ["--tensor-model-parallel-size", "2", "--use-megatron-fsdp"]
    whole, _ = run_many(2, [_args(corpus, "--use-megatron-fsdp"),
                            _args(corpus, "--use-megatron-fsdp", "--save", mf, *stop)])  # fmt: skip
    dp4, tp_whole, _, tp_resumed = run_many(
        4,
        [
            _args(corpus, "--use-megatron-fsdp", "--load", mf),
            _args(corpus, *tp),
            _args(corpus, *tp, "--save", tp_mf, *stop),
            _args(corpus, *tp, "--load", tp_mf),
        ],
    )
    _close(dp4["loss"], whole["loss"][2:])
    _close(dp4["grad_norm"], whole["grad_norm"][2:])
    _close(tp_resumed["loss"], tp_whole["loss"][2:])
    _close(tp_resumed["grad_norm"], tp_whole["grad_norm"][2:])


def test_sft_per_token_loss_equals_distributed_optimizer(tmp_path, hf_tok: str) -> None:
    """``posttrain --stage sft`` (the per-token loss: gradients divided by the batch's token
    count) under both FSDP paths equals the distributed optimizer, grad norm included."""
    import json

    from anyspeed.testing import run_distributed
    from helpers import sft_ranks
    from helpers.instruction import alpaca_records, preprocess

    src = tmp_path / "alpaca.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(40)))
    prefix = preprocess(str(src), str(tmp_path / "sft"), hf_tok)
    sft = ["--stage", "sft", "--model", "tiny-qwen2.5", "--num-layers", "2",
           "--padded-vocab-size", "640", "--seq-length", "64", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--train-iters", "3", "--lr", "2e-3", "--data-path",
           prefix, "--is-instruction-dataset", "--tokenizer-type", "PretrainedFromHF",
           "--tokenizer-name-or-path", hf_tok, "--split", "100,0,0", "--eval-iters", "0",
           "--no-progress-bar", "--untie-embeddings-and-output-weights", "--hidden-dropout",
           "0", "--attention-dropout", "0"]  # fmt: skip
    clis = [[*sft, f] for f in ("--use-distributed-optimizer", "--use-torch-fsdp2",
                                "--use-megatron-fsdp")]  # fmt: skip
    distopt, fsdp2, mfsdp = run_distributed(
        sft_ranks.posttrain_many, 2, argv=clis[0], clis=clis, timeout=300, fresh=True
    )[0]
    for run in (fsdp2, mfsdp):
        _close(run["loss"], distopt["loss"])
        _close(run["grad_norm"], distopt["grad_norm"])


def test_verify_refuses_the_fsdp_paths(corpus: str, capsys) -> None:
    """``anyspeed verify`` compares DDP gradients: an FSDP layout is one line, before start."""
    from anyspeed.commands.verify import main as verify

    for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp"):
        assert verify(["pretrain", "--nproc-per-node", "2", *_args(corpus, flag)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not compared yet" in err[0], err
