"""``anyspeed pretrain --load <HF dir>``: architecture from config.json, weights converted on the
fly; the first training loss equals transformers' own loss of the same model on the same batch
(Megatron's GPTDataset decides the batch)."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import run, write_corpus


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
    from anyspeed.training.pretrain import prepare

    monkeypatch.setenv("WORLD_SIZE", "2")
    args, _ = prepare(argv)
    assert args.load.startswith(str(tmp_path / "ck")) and args.padded_vocab_size == 512
    from anyspeed.training.datasets import build_datasets

    train = build_datasets(args)[0]
    losses = []
    with torch.no_grad():
        for mb in ([0, 1], [2, 3]):
            tokens = torch.stack([train[i]["tokens"] for i in mb])
            labels = torch.stack([train[i]["labels"] for i in mb])
            logits = model(input_ids=tokens).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    want = float(sum(losses) / len(losses))
    assert hist["loss"][0] == pytest.approx(want, rel=1e-5)
