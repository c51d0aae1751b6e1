"""``anyspeed pretrain --load <HF dir>``: architecture from config.json, weights converted on the
fly; the first training loss equals transformers' own loss of the same model on the same batch
(Megatron's GPTDataset decides the batch)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch
from test_pretrain import run, write_corpus


@pytest.mark.slow  # 21 s; the HF-load runs of every family are slow too (CI time budget)
def test_continue_pretraining_from_hf_directory(tmp_path, monkeypatch):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    corpus = write_corpus(str(tmp_path / "c_text_document"), docs=120)
    hf = str(tmp_path / "hf")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, rope_theta=10000.0)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(hf)
    argv = ["--load", hf, "--data-path", corpus, "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--split", "100,0,0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--log-interval", "1", "--no-progress-bar", "--tensor-model-parallel-size", "2",
            "--save", str(tmp_path / "ck")]  # fmt: skip
    hist = run(2, argv)[0]
    assert hist["iterations"] == [1, 2]

    # Independent reference: transformers on the first global batch of the same dataset.
    want, checked = hf_first_loss(model, argv, monkeypatch, world=2)
    assert checked.load.startswith(str(tmp_path / "ck"))
    assert checked.args.padded_vocab_size == 512
    assert hist["loss"][0] == pytest.approx(want, rel=1e-5)


def hf_first_loss(model, argv: list[str], monkeypatch, world: int = 1) -> tuple[float, object]:
    """transformers' loss on the first global batch (two micro-batches of 2) of the dataset
    ``anyspeed pretrain argv`` builds; and the run's parsed args."""
    from anyspeed.stages.common.gpt_data import build_datasets
    from anyspeed.stages.prepare import prepare

    monkeypatch.setenv("WORLD_SIZE", str(world))
    run, _ = prepare(argv)
    train = build_datasets(run.args, run.tokenizer)[0]
    losses = []
    with torch.no_grad():
        for mb in ([0, 1], [2, 3]):
            tokens = torch.stack([train[i]["tokens"] for i in mb])
            labels = torch.stack([train[i]["labels"] for i in mb])
            logits = model(input_ids=tokens).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    return float(sum(losses) / len(losses)), run


def test_new_weights_under_an_unchanged_config_are_converted_again(tmp_path, monkeypatch):
    """The conversion cache was keyed on config.json's mtime: weights replaced under the same
    config.json reused the stale conversion (first loss 6.21 of the old weights, not 8.18).
    Conversion runs in-process here (legacy format), standing in for the CLI subprocess."""
    import subprocess

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from anyspeed.convert import hf_cache as hf_load
    from anyspeed.convert import hf_to_megatron

    hf = tmp_path / "hf"
    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)  # fmt: skip
    calls = []

    def convert_in_process(cmd: list[str], **_) -> subprocess.CompletedProcess:
        calls.append(cmd)
        flag = dict(zip(cmd, cmd[1:], strict=False))
        hf_to_megatron(flag["--load-dir"], flag["--save-dir"], ckpt_format="legacy",
                       params_dtype=flag["--params-dtype"])  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hf_load.subprocess, "run", convert_in_process)

    def embedding(seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Save a model of ``seed`` (None: keep the files); (its embedding, the one
        ``--load <hf>`` would train from)."""
        if seed is not None:
            torch.manual_seed(seed)
            models[0] = Qwen2ForCausalLM(cfg)
            models[0].save_pretrained(hf)
            os.utime(hf / "config.json", ns=(stamp, stamp))  # config.json as it was
        ckpt = hf_load.convert(_conv(tmp_path / "ck"), str(hf))
        state = torch.load(f"{ckpt}/iter_0000001/mp_rank_00/model_optim_rng.pt")
        want = models[0].model.embed_tokens.weight.detach()
        return want, state["model"]["embedding.word_embeddings.weight"][: cfg.vocab_size]

    stamp, models = 1_700_000_000 * 10**9, [None]
    old, got = embedding(0)
    assert torch.equal(got, old) and len(calls) == 1
    assert embedding(None)[1].equal(old) and len(calls) == 1  # the same files: reused
    new, got = embedding(1)
    assert not torch.equal(new, old)
    assert torch.equal(got, new) and len(calls) == 2
    # Bytes changed in place with the size and mtime kept: the content hash still tells.
    path = hf / "model.safetensors"
    before, st = hf_load.weights_identity(str(hf)), path.stat()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert hf_load.weights_identity(str(hf)) != before


def test_conversion_cache_that_cannot_be_created_is_one_line(tmp_path):
    """--save in a read-only place: one line naming it, not a traceback from makedirs."""
    from anyspeed.convert import hf_cache as hf_load
    from anyspeed.errors import UsageError

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    save = (ro if not os.access(ro, os.W_OK) else Path("/sys")) / "ck"  # root ignores the mode
    with pytest.raises(UsageError, match=f"cannot create {save} for its conversion"):
        hf_load.convert(_conv(save), str(hf))


def _conv(save) -> argparse.Namespace:
    """The flags a conversion reads (defaults of ``anyspeed pretrain`` but --save)."""
    return argparse.Namespace(
        save=str(save),
        padded_vocab_size=None,
        bf16=False,
        fp16=False,
        tensor_model_parallel_size=1,
        make_vocab_size_divisible_by=128,
    )


def test_dropout_comes_from_the_hf_config_and_flags_win(tmp_path, capsys):
    """``--load <HF dir>``: the dropout the config records (0 where it records none), not
    Megatron's 0.1, and said in one line; a flag given wins (issue 43, item 5)."""
    import json

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from anyspeed.argv import get_flag
    from anyspeed.convert.hf_cache import expand

    hf = str(tmp_path / "hf")
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(hf)
    argv = expand(["--load", hf], hf)
    assert get_flag(argv, "--hidden-dropout") == "0.0"
    assert get_flag(argv, "--attention-dropout") == "0.0"
    assert "dropout from" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(cfg, attention_dropout=0.25)))
    argv = expand(["--load", hf, "--hidden-dropout", "0.3"], hf)
    assert get_flag(argv, "--hidden-dropout") == "0.3"
    assert get_flag(argv, "--attention-dropout") == "0.25"
    assert "attention 0.25 (--hidden-dropout as given)" in capsys.readouterr().out
    both = expand(["--load", hf, "--hidden-dropout", "0", "--attention-dropout", "0.1"], hf)
    assert get_flag(both, "--attention-dropout") == "0.1"
    assert "dropout from" not in capsys.readouterr().out  # both given: nothing to say


def test_a_checkpoint_resumes_from_its_own_model_record(tmp_path):
    """Resuming needs only ``--load``: the checkpoint's model record brings the architecture
    (about 20 flags had to be restated, and the error said only "--hidden-size is required";
    issue 43, item 11); flags given still win and are checked against the checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from anyspeed.convert import hf_to_megatron
    from anyspeed.errors import UsageError
    from anyspeed.models.hf import preset_from_hf
    from anyspeed.stages.prepare import prepare

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    mg = str(hf_to_megatron(tmp_path / "hf", tmp_path / "mg"))
    run = ["--load", mg, "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
           "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "511"]  # fmt: skip
    checked, _ = prepare(run, "launcher", "pretrain")
    want = preset_from_hf(cfg.to_dict())
    assert (checked.model.num_layers, checked.model.hidden_size) == (2, 64)
    assert checked.model.ffn_hidden_size == want.ffn_hidden_size
    with pytest.raises(UsageError, match="hidden"):  # a flag given wins, and must fit
        prepare([*run, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                 "4"], "launcher", "pretrain")  # fmt: skip
