"""``anyspeed pretrain --load <HF dir>`` of a tiny random DeepSeek-V3.2 (32-token sequences, 6
keys per query) with the indexer's KL loss on (``--dsa-indexer-loss-coeff 0.5``): the first
loss equals transformers' within 1e-5 (the KL loss trains only the indexer and is reported
apart, as ``indexer kl``). With ``-m slow``: the indexer's weights train with the loss and stay
as they were without it (transformers trains none), and at TP2 with sequence parallelism, PP2
and EP2 loss, grad norm and indexer KL equal the one-process run within 1e-5 over three
steps."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import _close, run_many, write_corpus
from test_pretrain_hf import hf_first_loss

from helpers import convert_ranks

COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--split", "100,0,0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
          "--no-progress-bar"]  # fmt: skip
KL = ["--dsa-indexer-loss-coeff", "0.5"]
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--num-layer-list", "2,1"],
    "ep2": ["--expert-model-parallel-size", "2", "--num-experts", "16",
            "--moe-token-dispatcher-type", "alltoall"],
}  # fmt: skip
INDEXER = "model.layers.0.self_attn.indexer.wq_b.weight"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds32_train")
    corpus = write_corpus(str(root / "c_text_document"), docs=120)
    convert_ranks.tiny_hf_model(root / "hf", "tiny-deepseek-v3.2", seed=3)
    for stand_in in ("tokenizer.json", "tokenizer_config.json"):  # token ids only
        (root / "hf" / stand_in).unlink()
    argv = ["--load", str(root / "hf"), "--data-path", corpus, *COMMON]
    (with_kl,) = run_many(1, [argv + KL + ["--save", str(root / "kl")]])
    return root, argv, with_kl


def test_first_loss_equals_transformers(runs, monkeypatch):
    from transformers import AutoModelForCausalLM

    root, argv, with_kl = runs
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    want, _ = hf_first_loss(model, argv, monkeypatch)
    assert with_kl["loss"][0] == pytest.approx(want, rel=1e-5)
    kl = with_kl["metrics"]["indexer kl"]
    assert len(kl) == 3 and all(0 < k < 10 for k in kl)


@pytest.mark.slow  # one more run and two conversions (CI time)
def test_indexer_trains_only_with_its_loss(runs, tmp_path, monkeypatch):
    """Read back through the converter (the checkpoints as a user exports them); the run
    without the loss starts at transformers' loss too."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from anyspeed.convert import megatron_to_hf

    root, argv, _ = runs
    (without,) = run_many(1, [argv + ["--save", str(root / "plain")]])
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    want, _ = hf_first_loss(model, argv, monkeypatch)
    assert without["loss"][0] == pytest.approx(want, rel=1e-5)
    weights = {}
    for name in ("kl", "plain"):
        megatron_to_hf(root / name, tmp_path / name, root / "hf")
        weights[name] = {k: v for f in (tmp_path / name).glob("*.safetensors")
                         for k, v in load_file(str(f)).items()}  # fmt: skip
    start = load_file(str(root / "hf" / "model.safetensors"))
    for key in (INDEXER, INDEXER.replace("wq_b", "k_norm").replace(".weight", ".bias")):
        assert not torch.equal(weights["kl"][key], start[key])
        assert torch.equal(weights["plain"][key], start[key])
    main = "model.layers.0.self_attn.q_b_proj.weight"  # the rest trains either way
    assert not torch.equal(weights["plain"][main], start[main])


@pytest.mark.slow  # three two-process runs; the fast twins: the one-process run above, TP2 logits
def test_layouts_equal_one_process(runs, tmp_path):
    _, argv, with_kl = runs
    argvs = [
        argv + KL + flags + ["--save", str(tmp_path / name)] for name, flags in LAYOUTS.items()
    ]
    for run in run_many(2, argvs):
        _close(run["loss"], with_kl["loss"])
        _close(run["grad_norm"], with_kl["grad_norm"])
        _close(run["metrics"]["indexer kl"], with_kl["metrics"]["indexer kl"])
