"""``anyspeed posttrain --stage dpo|simpo`` refuses bad input with one line naming the flag or
file, before any process group or conversion starts."""

from __future__ import annotations

import os

import pytest
from test_dpo import cli
from test_posttrain_errors import _error


@pytest.fixture(scope="module")
def other_arch(tmp_path_factory) -> str:
    """A Megatron checkpoint of another architecture (hidden 32, not 64)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from anyspeed.convert import hf_to_megatron

    d = tmp_path_factory.mktemp("other")
    cfg = Qwen2Config(vocab_size=768, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(d / "hf")
    return str(hf_to_megatron(d / "hf", d / "mg"))


def test_pairwise_dataset_missing_its_rejected_files(capsys, pair_data, tiny_qwen, tmp_path):
    prefix = str(tmp_path / "half")
    for kind in ("chosen_input_ids", "chosen_labels", "rejected_input_ids"):
        for ext in (".bin", ".idx"):
            os.symlink(f"{pair_data}_packed_{kind}_document{ext}",
                       f"{prefix}_packed_{kind}_document{ext}")  # fmt: skip
    err = _error(capsys, cli(tiny_qwen, prefix))
    assert "half_packed_rejected_labels_document.bin/.idx does not exist" in err


def test_dpo_on_sft_data_and_sft_on_pairs(capsys, pair_data, sft_data, tiny_qwen):
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"]))
    assert "is an instruction (SFT) dataset, not a pairwise one" in err
    from test_sft_loss import cli as sft_cli

    err = _error(capsys, sft_cli(tiny_qwen, pair_data))
    assert "is a pairwise (preference) dataset" in err and "--stage dpo" in err


def test_missing_pairwise_flag(capsys, pair_data, tiny_qwen):
    argv = [a for a in cli(tiny_qwen, pair_data) if a != "--is-pairwise-dataset"]
    assert "add --is-pairwise-dataset" in _error(capsys, argv)


def test_reference_of_another_architecture(capsys, pair_data, tiny_qwen, other_arch):
    err = _error(capsys, cli(tiny_qwen, pair_data, "--ref-model", other_arch))
    assert err.count("--ref-model") == 1 and "another architecture" in err
    assert "hidden" in err


def test_reference_that_is_not_a_checkpoint(capsys, pair_data, tiny_qwen, tmp_path):
    err = _error(capsys, cli(tiny_qwen, pair_data, "--ref-model", str(tmp_path)))
    assert "is not a checkpoint directory" in err


def test_no_reference_and_bad_numbers(capsys, pair_data, tiny_qwen):
    argv = cli(tiny_qwen, pair_data)
    i = argv.index("--load")
    no_load = argv[:i] + argv[i + 2 :] + ["--num-layers", "2", "--hidden-size", "64",
                                          "--num-attention-heads", "4", "--vocab-size", "768",
                                          "--max-position-embeddings", "256"]  # fmt: skip
    assert "needs a reference model" in _error(capsys, no_load)
    err = _error(capsys, cli(tiny_qwen, pair_data, "--dpo-label-smoothing", "0.5"))
    assert "--dpo-label-smoothing must be < 0.5 (got 0.5)" in err
    for flag, value, line in (
        ("--dpo-beta", "inf", "--dpo-beta must be a finite number (got inf)"),
        ("--pref-ftx", "nan", "--pref-ftx must be a finite number (got nan)"),
        ("--pref-ftx", "-1", "--pref-ftx must be >= 0 (got -1)"),
    ):
        assert line in _error(capsys, cli(tiny_qwen, pair_data, flag, value))
    err = _error(capsys, cli(tiny_qwen, pair_data, "--simpo-beta", "0", stage="simpo"))
    assert "--simpo-beta must be > 0 (got 0)" in err
    err = _error(capsys, cli(tiny_qwen, pair_data, "--dpo-beta", "1", stage="simpo"))
    assert "unsupported flag --dpo-beta" in err
    assert "`anyspeed posttrain --stage simpo --help`" in err


def test_ref_model_with_lora(capsys, pair_data, tiny_qwen, other_arch):
    argv = cli(tiny_qwen, pair_data, "--ref-model", other_arch, "--lora-target-modules",
               "linear_qkv")  # fmt: skip
    assert "--ref-model with LoRA" in _error(capsys, argv)


def test_pairs_with_nothing_to_prefer_are_refused(capsys, pair_data, tiny_qwen, tmp_path):
    """Pairs whose chosen and rejected answers are the same tokens teach nothing (loss ln 2,
    gradient 0): a run where every training pair is such is refused before start (issue 43,
    item 1). The data: the pairwise set with its rejected columns replaced by its chosen ones."""
    import shutil

    same = str(tmp_path / "same")
    for kind in ("input_ids", "labels"):
        for ext in (".bin", ".idx"):
            src = f"{pair_data}_packed_chosen_{kind}_document{ext}"
            shutil.copy(src, f"{same}_packed_chosen_{kind}_document{ext}")
            shutil.copy(src, f"{same}_packed_rejected_{kind}_document{ext}")
    for stage in ("dpo", "orm"):
        err = _error(capsys, cli(tiny_qwen, same, stage=stage))
        assert "chosen and rejected answers are the same tokens" in err, err


def test_damaged_reference_is_one_line_before_start(capsys, pair_data, tiny_qwen, tmp_path):
    """``--ref-model`` gets the checks ``--load`` gets (issue 43, item 4): a damaged common
    state or a truncated tensor file is one line naming ``--ref-model``, before start."""
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.convert import hf_to_megatron

    for damage in ("common.pt", ".distcp"):
        ref = str(hf_to_megatron(tiny_qwen, tmp_path / damage.strip(".")))
        it_dir = tracked_dir(ref)
        name = next(n for n in sorted(os.listdir(it_dir)) if n.endswith(damage))
        path = os.path.join(it_dir, name)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        err = _error(capsys, cli(tiny_qwen, pair_data, "--ref-model", ref))
        assert err.count("--ref-model") == 1 and "--load" not in err, err
