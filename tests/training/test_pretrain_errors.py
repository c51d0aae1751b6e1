"""``anyspeed pretrain`` refuses bad input with one line before any process group starts,
and a diverging run stops on a NaN loss without touching the last good checkpoint."""

from __future__ import annotations

import os

import pytest
from test_pretrain import base_args, write_corpus

from anyspeed.commands.train import pretrain as main
from anyspeed.testing import DistributedError, run_distributed
from helpers import pretrain_ranks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data") / "c_text_document"), docs=60)


def _error(capsys, argv: list[str]) -> str:
    """Run the command in-process (no launcher); it must fail with exit 2 and one line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("anyspeed pretrain: error: ")
    return err


def test_missing_data_files(capsys, tmp_path, corpus):
    err = _error(capsys, base_args(str(tmp_path / "nothing"), 2))
    assert "--data-path" in err and "nothing.bin does not exist" in err


def test_prefix_with_extension(capsys, corpus):
    err = _error(capsys, base_args(corpus + ".bin", 2))
    assert "give the prefix without .bin/.idx" in err


def test_not_an_indexed_dataset(capsys, tmp_path):
    prefix = str(tmp_path / "junk")
    for ext in (".bin", ".idx"):
        open(prefix + ext, "wb").write(b"not a megatron index at all")
    err = _error(capsys, base_args(prefix, 2))
    assert "not a Megatron indexed dataset" in err


def test_token_ids_beyond_vocabulary(capsys, corpus):
    argv = base_args(corpus, 2)
    argv[argv.index("--padded-vocab-size") + 1] = "256"  # the corpus holds ids up to 499
    err = _error(capsys, argv)
    assert "token id 499" in err and "vocabulary size 256" in err


def test_global_batch_not_divisible(capsys, corpus):
    argv = base_args(corpus, 2) + ["--nproc-per-node", "2"]
    argv[argv.index("--global-batch-size") + 1] = "6"  # micro 2 x DP 2 = 4 does not divide 6
    err = _error(capsys, argv)
    assert "--global-batch-size 6 is not divisible by --micro-batch-size 2" in err


def test_unsupported_flag(capsys, corpus):
    err = _error(capsys, base_args(corpus, 2) + ["--fp4-format", "nvfp4"])
    assert "unsupported flag --fp4-format" in err


def test_layout_that_cannot_shard(capsys, corpus):
    argv = base_args(corpus, 2) + ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2",
                                   "--num-attention-heads", "3"]  # fmt: skip
    err = _error(capsys, argv)
    assert "--num-attention-heads 3" in err or "attention heads" in err


def test_unknown_preset(capsys, corpus):
    err = _error(capsys, base_args(corpus, 2) + ["--model", "gpt-17"])
    assert "unknown preset" in err and "qwen2.5-7b" in err


@pytest.mark.slow  # end to end; the NaN guard itself is tested in test_loop.py (time budget)
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, corpus):
    save = str(tmp_path / "ck")
    argv = base_args(corpus, 6) + ["--save", save, "--save-interval", "2"]
    with pytest.raises(DistributedError, match=r"loss is nan at iteration 3; stopping") as info:
        run_distributed(pretrain_ranks.pretrain, 1, argv=argv, cli=argv, nan_at=3, timeout=240)
    assert "last good checkpoint: iteration 2" in str(info.value)
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"
    left = sorted(f for f in os.listdir(save) if f != ".anyspeed.lock")  # the --save lock stays
    assert left == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    (hist,) = run_distributed(pretrain_ranks.pretrain, 1, argv=argv, cli=argv + ["--load", save],
                              timeout=240)  # fmt: skip
    assert hist["iterations"] == [3, 4, 5, 6]  # the good checkpoint resumes


@pytest.mark.slow  # a whole training run; the suite's time budget
def test_load_of_an_empty_directory_starts_from_scratch(tmp_path, corpus):
    """As in Megatron-LM, --load DIR --save DIR on the first run trains from scratch."""
    ck = str(tmp_path / "ck")
    argv = base_args(corpus, 2) + ["--load", ck, "--save", ck]
    (hist,) = run_distributed(pretrain_ranks.pretrain, 1, argv=argv, cli=argv, timeout=240)
    assert hist["iterations"] == [1, 2]
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "2"


def test_finetune_without_a_checkpoint(capsys, tmp_path, corpus):
    err = _error(capsys, base_args(corpus, 2) + ["--load", str(tmp_path), "--finetune"])
    assert "--finetune needs a checkpoint" in err


def test_split_with_no_documents(capsys, corpus):
    """60 documents and a 1-in-1000 test share: Megatron would spin forever building the empty
    test split; the check names the split instead."""
    argv = base_args(corpus, 2)
    argv[argv.index("--split") + 1] = "969,30,1"
    err = _error(capsys, argv)
    assert "--split 969,30,1: the test split" in err and "gets none of its documents" in err


def test_no_evaluation_needs_no_held_out_documents(tmp_path, corpus):
    """Issue 43 item 12: with ``--eval-iters 0`` nothing reads the validation or test split, so
    one that gets no document is no reason to refuse; training reads the same samples as when
    the held-out splits are built (its boundary does not move)."""
    import argparse

    from anyspeed.stages.common.gpt_data import build_datasets

    argv = base_args(corpus, 2)
    argv[argv.index("--split") + 1] = "969,30,1"
    argv[argv.index("--eval-iters") + 1] = "0"
    (hist,) = run_distributed(pretrain_ranks.pretrain, 1, argv=argv, cli=argv, timeout=240)
    assert hist["iterations"] == [1, 2]

    args = argparse.Namespace(
        seed=7, seq_length=32, mock_data=False, data_path=[corpus], split="969,30,1",
        data_cache_path=str(tmp_path), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, padded_vocab_size=512, global_batch_size=8, train_iters=2,
        eval_interval=2, eval_iters=0,
    )  # fmt: skip
    train, valid, test = build_datasets(args)
    assert valid is None and test is None
    args.eval_iters, args.split = 1, "969,31,0"  # the same training share; validation built
    same, valid, _ = build_datasets(args)
    assert valid is not None and len(train) == len(same)
    assert all((train[i]["tokens"] == same[i]["tokens"]).all() for i in range(len(train)))
