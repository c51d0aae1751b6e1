"""``anyspeed posttrain`` refuses bad input with one line naming the flag or file, before any
process group or conversion starts."""

from __future__ import annotations

import os

import torch
from test_sft_loss import cli

from anyspeed.commands.train import posttrain as main

LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "--lora-r", "4"]


def _error(capsys, argv: list[str]) -> str:
    """Run the command in-process (no launcher); it must fail with exit 2 and one line."""
    os.environ.pop("WORLD_SIZE", None)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
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


def test_lora_load_of_another_rank(capsys, sft_data, tiny_qwen, tmp_path):
    ckpt = tmp_path / "lora"
    (ckpt / "iter_0000002").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    (ckpt / "iter_0000002" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    saved = {"r": 8, "alpha": 16.0, "target_modules": ["linear_proj", "linear_qkv"]}
    torch.save({"iteration": 2, "anyspeed_lora": saved}, ckpt / "iter_0000002" / "common.pt")
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], *LORA, "--lora-load", str(ckpt)))
    assert "was trained with --lora-r 8, not 4" in err


def test_packed_flags_on_unpacked_data(capsys, sft_data, tiny_qwen):
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], "--neat-pack"))
    assert "is not packed" in err
