"""``anyspeed pretrain --load <HF dir>`` for expert-parallel and uneven-pipeline layouts.

A tiny Qwen3-MoE model trains at EP2 (all-to-all dispatcher); a 3-layer Qwen2 model and a
3-layer DeepSeek-V2-Lite-style model (multi-latent attention, a dense first layer, shared
experts) train at PP2 with uneven stages (MindSpeed-LLM's ``--num-layer-list 1,2``). The first
loss of each equals
transformers' loss of the same model on the same batch (Megatron's GPTDataset decides it)
within 1e-5, and the uneven PP2 runs' losses equal the one-process runs' within 1e-5 (fp32).
"""

from __future__ import annotations

import pytest
import torch
from test_pretrain import _close, run_many, write_corpus
from test_pretrain_hf import hf_first_loss

pytestmark = pytest.mark.slow  # three process groups: kept out of CI's time budget

COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--split", "100,0,0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
          "--no-progress-bar"]  # fmt: skip


UNEVEN = ["deepseek-v2-lite-pp2-uneven", "qwen2-3layers-pp2-uneven"]


def _models() -> dict[str, tuple[object, list[str]]]:
    from transformers import DeepseekV2Config, Qwen2Config, Qwen3MoeConfig

    small = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, rope_theta=10000.0)  # fmt: skip
    return {
        "qwen3-moe-ep2": (
            Qwen3MoeConfig(
                **small,
                intermediate_size=96,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                head_dim=16,
                num_hidden_layers=2,
            ),  # fmt: skip
            [
                "--expert-model-parallel-size",
                "2",
                "--num-experts",
                "8",
                "--moe-token-dispatcher-type",
                "alltoall",
            ],  # fmt: skip
        ),
        "deepseek-v2-lite-pp2-uneven": (
            DeepseekV2Config(
                **{**small, "num_key_value_heads": 4},  # MLA: one KV head per query head
                intermediate_size=96,
                moe_intermediate_size=32,
                n_routed_experts=8,
                n_shared_experts=2,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                kv_lora_rank=32,
                q_lora_rank=None,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                num_hidden_layers=3,
            ),  # fmt: skip
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layer-list",
                "1,2",
                "--num-experts",
                "8",
            ],  # fmt: skip
        ),
        "qwen2-3layers-pp2-uneven": (
            Qwen2Config(
                **small, intermediate_size=176, num_hidden_layers=3, tie_word_embeddings=True
            ),  # fmt: skip
            ["--pipeline-model-parallel-size", "2", "--num-layer-list", "1,2"],
        ),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_families")
    corpus = write_corpus(str(root / "c_text_document"), docs=120)
    models, argvs = {}, {}
    for i, (name, (cfg, _)) in enumerate(_models().items()):
        torch.manual_seed(i)
        models[name] = AutoModelForCausalLM.from_config(cfg).eval()
        models[name].save_pretrained(str(root / name))
        argvs[name] = ["--load", str(root / name), "--data-path", corpus, *COMMON,
                       "--save", str(root / f"ck-{name}")]  # fmt: skip
    two = run_many(2, [argvs[n] + flags for n, (_, flags) in _models().items()])
    pp1 = run_many(1, [argvs[n] + ["--save", str(root / f"ck-pp1-{n}")] for n in UNEVEN])
    return models, argvs, dict(zip(argvs, two, strict=True)), dict(zip(UNEVEN, pp1, strict=True))


@pytest.mark.parametrize("name", list(_models()))
def test_first_loss_equals_transformers(runs, name, monkeypatch):
    models, argvs, hists, _ = runs
    hist = hists[name]
    assert hist["iterations"] == [1, 2, 3]
    want, _ = hf_first_loss(models[name], argvs[name], monkeypatch)
    assert hist["loss"][0] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", UNEVEN)
def test_uneven_pipeline_equals_one_process(runs, name):
    _, _, hists, pp1 = runs
    _close(hists[name]["loss"], pp1[name]["loss"])
    _close(hists[name]["grad_norm"], pp1[name]["grad_norm"])
