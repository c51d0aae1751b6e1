"""``anyspeed posttrain`` refuses bad input with one line naming the flag or file, before any
process group or conversion starts."""

from __future__ import annotations

import os

import pytest
from test_sft_loss import cli

from anyspeed.commands.train import posttrain as main
from anyspeed.stages.prepare import prepare
from helpers.inprocess import clean_after

LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "--lora-r", "4"]


def _error(capsys, argv: list[str]) -> str:
    """Run the command in-process (no launcher); it must fail with exit 2 and one line."""
    os.environ.pop("WORLD_SIZE", None)
    from anyspeed import quiet

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    # the once-per-process notice about hidden third-party warnings comes first when this is
    # the first test of the worker to import them
    err = "\n".join(line for line in err.splitlines() if line != quiet.notice())
    assert len(err.splitlines()) == 1, err
    assert err.startswith("anyspeed posttrain: error: ")
    return err


def test_dataset_without_labels(capsys, sft_data, tiny_qwen, tmp_path):
    prefix = str(tmp_path / "nolabels")
    for kind in ("input_ids", "attention_mask"):
        for ext in (".bin", ".idx"):
            src = f"{sft_data['padded']}_packed_{kind}_document{ext}"
            os.symlink(src, f"{prefix}_packed_{kind}_document{ext}")
    err = _error(capsys, cli(tiny_qwen, prefix))
    assert "nolabels_packed_labels_document.bin/.idx does not exist" in err


def test_pretraining_data_or_missing_flag(capsys, sft_data, tiny_qwen):
    argv = [a for a in cli(tiny_qwen, sft_data["padded"]) if a != "--is-instruction-dataset"]
    assert "add --is-instruction-dataset" in _error(capsys, argv)


def test_unknown_prompt_type(capsys, sft_data, tiny_qwen):
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], "--prompt-type", "qwen9"))
    assert "--prompt-type 'qwen9' is unknown" in err and "llama3" in err


def test_lora_target_that_does_not_exist(capsys, sft_data, tiny_qwen):
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], "--lora-target-modules", "q_proj"))
    assert "--lora-target-modules 'q_proj' is not a layer" in err and "linear_qkv" in err


@pytest.fixture(scope="module")
def lora_ckpt(sft_data, tmp_path_factory) -> str:
    """A real LoRA checkpoint (--lora-r 4, --lora-alpha 32, qkv + proj) of one step."""
    from test_sft_lengths import _argv

    lora = str(tmp_path_factory.mktemp("lora") / "ck")
    argv = _argv(sft_data["padded"], sft_data["tok"], 96, *LORA, "--save", lora,
                 "--no-progress-bar", "--eval-iters", "0")  # fmt: skip
    os.environ.pop("WORLD_SIZE", None)
    with clean_after():  # it trained in this process
        assert main(argv) == 0
    return lora


def test_lora_load_of_another_rank(capsys, sft_data, tiny_qwen, lora_ckpt):
    argv = cli(tiny_qwen, sft_data["padded"], *LORA[:-1], "8", "--lora-load", lora_ckpt)
    err = _error(capsys, argv)
    assert "was trained with --lora-r 4, not 8" in err


def test_lora_load_of_another_alpha(capsys, sft_data, tiny_qwen, lora_ckpt):
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], *LORA, "--lora-alpha", "8",
                             "--lora-load", lora_ckpt))  # fmt: skip
    assert "was trained with --lora-alpha 32.0, not 8.0" in err


@pytest.mark.parametrize("flag", [["--lora-r", "8"], ["--lora-alpha", "16"],
                                  ["--lora-dropout", "0.1"],
                                  ["--lora-modules-to-save", "output_layer"]])  # fmt: skip
def test_lora_flags_without_targets(capsys, sft_data, tiny_qwen, flag):
    """Without --lora-target-modules the run would be full fine-tuning: refused."""
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], *flag))
    assert f"{flag[0]} needs --lora-target-modules" in err


def test_resuming_another_stage_needs_finetune(capsys, sft_data, tmp_path):
    """A pretraining checkpoint under --stage sft without --finetune would continue its
    iteration count and optimizer silently: refused, naming both stages."""
    from test_sft_lengths import _argv, arch

    from anyspeed.commands.train import pretrain

    ckpt = str(tmp_path / "pre")
    flags = ["--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0", "--save", ckpt,
             "--no-progress-bar"]  # fmt: skip
    with clean_after():  # it trained in this process
        assert pretrain([*arch(sft_data["tok"], 96), *flags]) == 0
    capsys.readouterr()
    err = _error(capsys, _argv(sft_data["padded"], sft_data["tok"], 96, "--load", ckpt))
    assert "holds a pretrain checkpoint and this run is sft: add --finetune" in err
    os.environ.pop("WORLD_SIZE", None)
    run, _ = prepare(_argv(sft_data["padded"], sft_data["tok"], 96, "--load", ckpt,
                           "--finetune"), "launcher", "posttrain")  # fmt: skip
    assert run.load == ckpt  # with --finetune it starts from the weights


def test_packed_flags_on_unpacked_data(capsys, sft_data, tiny_qwen):
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], "--neat-pack"))
    assert "is not packed" in err


def test_tampered_lora_load_names_lora_load(capsys, sft_data, lora_ckpt, tmp_path):
    """A --lora-load checkpoint with a truncated data file: one line before start that names
    --lora-load (not --load, which is the base)."""
    import shutil

    from test_sft_lengths import _argv

    lora = str(tmp_path / "lora")
    shutil.copytree(lora_ckpt, lora)
    data = sorted((tmp_path / "lora" / "iter_0000001").glob("*.distcp"))
    data[0].write_bytes(data[0].read_bytes()[:10])
    argv = _argv(sft_data["padded"], sft_data["tok"], 96, *LORA, "--lora-load", lora)
    err = _error(capsys, argv)
    assert f"--lora-load {lora!r}" in err and "--load " not in err, err


def test_lora_targets_on_mla_are_checked():
    """On MLA ``linear_qkv`` is MindSpeed-LLM's fused down-projection adapter: naming one of
    its layers too is one line, and so is an MLA layer on a model without MLA."""
    import argparse

    from anyspeed.errors import UsageError
    from anyspeed.training import lora

    args = argparse.Namespace(
        lora_target_modules=["linear_qkv", "linear_kv_down_proj"], lora_r=None, lora_alpha=None,
        lora_dropout=None, lora_modules_to_save=[], lora_load=None, seed=1,
        multi_latent_attention=True,
    )  # fmt: skip
    with pytest.raises(UsageError, match="linear_qkv and linear_kv_down_proj: on multi-latent"):
        lora.from_args(args)
    for targets in (["linear_qkv", "linear_fc1"], ["linear_kv_down_proj", "linear_fc1"]):
        args.lora_target_modules = targets
        assert lora.from_args(args).target_modules == tuple(targets)
    args.lora_target_modules = ["linear_q_down_proj"]  # queries without a low rank
    with pytest.raises(UsageError, match="linear_q_down_proj: this model .no --q-lora-rank."):
        lora.from_args(args)
    args.q_lora_rank, args.lora_target_modules = 24, ["linear_q_proj"]
    with pytest.raises(UsageError, match="linear_q_proj: this model .--q-lora-rank. has no"):
        lora.from_args(args)
    args.lora_target_modules = ["linear_kv_down_proj"]
    args.multi_latent_attention = False  # MLA's projections on a model without MLA
    with pytest.raises(UsageError, match="linear_kv_down_proj: a layer of multi-latent"):
        lora.from_args(args)
