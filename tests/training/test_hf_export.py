"""MindSpeed-LLM's ``--enable-mg2hf-convert``: a run that saves also leaves its latest weights
as a Hugging Face directory. Each save (or with ``--only-convert-last-checkpoint`` the last) is
exported; the export's transformers logits equal the saved checkpoint's Megatron logits; an
export that fails is one warning line and the run goes on; at TP2 rank 0 converts in a process
of its own (``-m slow``); a LoRA run exports the base merged with its adapters, as
``anyspeed convert --lora-load`` does; bad flags are one line."""

from __future__ import annotations

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import pretrain_ranks, sft_ranks
from helpers.convert_ranks import hf_tensors


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = str(tmp_path_factory.mktemp("export") / "hf")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=768, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, rope_theta=10000.0)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


def _cli(hf: str, save: str, *extra: str) -> list[str]:
    return ["--load", hf, "--finetune", "--mock-data", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
            "--lr", "1e-2", "--save", save, "--save-interval", "2", "--eval-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--no-progress-bar", "--tokenizer-type", "NullTokenizer", "--vocab-size", "767",
            *extra]  # fmt: skip


def test_saves_are_exported_and_equal_the_checkpoint(hf, tmp_path):
    from anyspeed.convert import verify

    every = _cli(hf, str(tmp_path / "ck"), "--enable-mg2hf-convert")
    out = str(tmp_path / "out")
    last = _cli(hf, str(tmp_path / "ck2"), "--enable-mg2hf-convert",
                "--only-convert-last-checkpoint", "--hf-save-dir", out)  # fmt: skip
    (tmp_path / "file").write_text("not a directory")
    bad = _cli(hf, str(tmp_path / "ck3"), "--enable-mg2hf-convert",
               "--only-convert-last-checkpoint", "--hf-save-dir",
               str(tmp_path / "file" / "hf"))  # fmt: skip
    a, b, c = run_distributed(pretrain_ranks.pretrain_many, 1, argv=every,
                              clis=[every, last, bad], timeout=300)[0]  # fmt: skip
    assert a["exported"] == [2, 4] and b["exported"] == [4]
    # an export that fails (its directory under a file) is a warning line: the run goes on
    assert c["export_failed"] == [4] and c["iterations"][-1] == 4 and "exported" not in c
    export = tmp_path / "ck_hf"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck_hf")) == ["ck_hf"]
    assert verify(export, tmp_path / "ck", tolerance=1e-5) <= 1e-5  # iteration 4's weights
    start, got = hf_tensors(hf), hf_tensors(export)
    assert start.keys() == got.keys()
    assert any(not torch.equal(start[k], got[k]) for k in start)  # trained, not the start
    assert verify(tmp_path / "out", tmp_path / "ck2", tolerance=1e-5) <= 1e-5


@pytest.mark.slow  # 2 processes; the same conversion process runs in the fast tests
def test_at_tp2_a_rank_runs_the_conversion_in_its_own_process(hf, tmp_path):
    """At TP2 the conversion cannot run in a rank (it builds a one-rank Megatron): rank 0 runs
    it as a process of its own."""
    from anyspeed.convert import verify

    good = _cli(hf, str(tmp_path / "ck"), "--nproc-per-node", "2",
                "--tensor-model-parallel-size", "2", "--enable-mg2hf-convert",
                "--only-convert-last-checkpoint")  # fmt: skip
    (a,) = run_distributed(pretrain_ranks.pretrain_many, 2, argv=good, clis=[good],
                           timeout=300)[0]  # fmt: skip
    assert a["exported"] == [4] and "export_failed" not in a
    assert verify(tmp_path / "ck_hf", tmp_path / "ck", tolerance=1e-5) <= 1e-5


def test_a_lora_run_exports_the_merged_model(hf, hf_tok, tmp_path):
    """SFT-LoRA's export: the --load base merged with the saved adapters, tensor for tensor
    what anyspeed convert --lora-load writes from the same checkpoint."""
    from anyspeed.commands.convert import main as convert
    from anyspeed.convert import hf_to_megatron
    from helpers.corpora import write_jsonl
    from helpers.instruction import alpaca_records, preprocess

    base = str(hf_to_megatron(hf, tmp_path / "base"))
    data = preprocess(write_jsonl(str(tmp_path / "a.jsonl"), alpaca_records(8)),
                      str(tmp_path / "sft"), hf_tok)  # fmt: skip
    save = str(tmp_path / "lora")
    lora = ["--lora-target-modules", "linear_qkv", "linear_fc1", "--lora-r", "4"]
    argv = ["--stage", "sft", "--is-instruction-dataset", "--load", base, "--finetune",
            "--data-path", data, "--tokenizer-type", "PretrainedFromHF",
            "--tokenizer-name-or-path", hf_tok, "--seq-length", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2", "--save", save,
            "--split", "100,0,0", "--eval-iters", "0", "--no-progress-bar",
            "--enable-mg2hf-convert", *lora]  # fmt: skip
    hist = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    assert hist["exported"] == [2]
    assert convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", base,
                    "--lora-load", save, "--lora-r", "4", "--lora-target-modules", "linear_qkv",
                    "linear_fc1", "--hf-cfg-dir", hf_tok,
                    "--save-dir", str(tmp_path / "cli")]) == 0  # fmt: skip
    got, want = hf_tensors(save + "_hf"), hf_tensors(tmp_path / "cli")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(got[k], hf_tensors(hf)[k]) for k in want)  # the adapters merged
    assert (tmp_path / "lora_hf" / "tokenizer.json").is_file()  # --tokenizer-name-or-path's


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--only-convert-last-checkpoint"], "add --enable-mg2hf-convert"),
        (["--enable-mg2hf-convert", "--hf-save-dir", "SAVE"], "is --save or inside it"),
        (["--enable-mg2hf-convert", "--hf-save-dir", "SAVE/hf"], "is --save or inside it"),
    ],
)
def test_bad_flags_are_one_line(extra, message, hf, tmp_path):
    from anyspeed.errors import UsageError
    from anyspeed.stages.prepare import prepare

    save = str(tmp_path / "ck")
    with pytest.raises(UsageError, match=message):
        prepare(_cli(hf, save, *[x.replace("SAVE", save) for x in extra]), "launcher")
    no_save = [x for x in _cli(hf, save, "--enable-mg2hf-convert") if x not in ("--save", save)]
    with pytest.raises(UsageError, match="pass --save DIR"):
        prepare(no_save, "launcher")
