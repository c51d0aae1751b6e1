"""MindSpeed-LLM's conversion scripts carry over: ``ckpt_convert_*_hf2mcore.sh`` pass the run's
layout (``--moe-grouped-gemm``, ``--expert-tensor-parallel-size``,
``--num-layers-per-virtual-pipeline-stage``) and the model again (``--num-layers`` with its
``--noop-layers`` slots, ``--first-k-dense-replace``). The conversion with them is checked
against transformers (``--verify``); a model flag the source contradicts, or a layout the legacy
files cannot hold, is one line before anything is written."""

from __future__ import annotations

import pytest

from anyspeed.commands.convert import main
from helpers.convert_ranks import tiny_hf_model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny DeepSeek-V2-Lite (a dense first layer, then MoE layers)."""
    d = tmp_path_factory.mktemp("ms_convert") / "hf"
    tiny_hf_model(d, "tiny-deepseek-v2-lite", seed=4)
    return str(d)


def test_the_scripts_flags_convert_as_transformers_reads(deepseek, tmp_path, capsys):
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", deepseek,
            "--save-dir", str(tmp_path / "mg"), "--target-tensor-parallel-size", "1",
            "--target-expert-parallel-size", "2", "--moe-grouped-gemm",
            "--expert-tensor-parallel-size", "1", "--num-layers-per-virtual-pipeline-stage", "1",
            "--num-layers", "4", "--noop-layers", "3", "--first-k-dense-replace", "1",
            "--mla-mm-split", "--verify"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert "--moe-grouped-gemm --expert-tensor-parallel-size" in out.err and "accepted" in out.err
    assert "verify" in out.out.lower()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("--num-layers 4", "--num-layers 4: the model has 3 layers"),
        ("--num-layers 3 --noop-layers 2", "the model has 3 layers + 1 --noop-layers slots"),
        ("--first-k-dense-replace 2", "--first-k-dense-replace 2: the model's MoE layers are "
         "[1, 2]"),
        ("--ckpt-format legacy --moe-grouped-gemm", "--moe-grouped-gemm: the legacy rank files"),
        ("--ckpt-format legacy --num-layers-per-virtual-pipeline-stage 1",
         "--num-layers-per-virtual-pipeline-stage: the legacy rank files"),
        ("--source-tensor-parallel-size 2", "--source-*-parallel-size describe a Megatron"),
    ],
)  # fmt: skip
def test_what_contradicts_is_one_line_and_writes_nothing(deepseek, tmp_path, capsys, flags, words):
    save = tmp_path / "mg"
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", deepseek,
            "--save-dir", str(save), *flags.split()]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not save.exists()
