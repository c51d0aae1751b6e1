"""Shared fixtures of the fine-tuning tests: a small alpaca set preprocessed (padded and
neat-packed) with the session's trained tokenizer, and a tiny random Qwen2 HF model."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.corpora import write_jsonl
from helpers.instruction import VOCAB, alpaca_records, pairwise_records, preprocess
from helpers.prm import preprocess_steps, step_records


@pytest.fixture(scope="session")
def sft_data(hf_tok: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Eight alpaca samples, preprocessed unpacked and neat-packed (seq 192)."""
    d = tmp_path_factory.mktemp("sft")
    src = write_jsonl(str(d / "a.jsonl"), alpaca_records(8))
    return {
        "padded": preprocess(src, str(d / "pad"), hf_tok),
        "packed": preprocess(
            src, str(d / "pack"), hf_tok, "--pack", "--neat-pack", "--seq-length", "192"
        ),
        "tok": hf_tok,
    }


@pytest.fixture(scope="session")
def pair_data(hf_tok: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Eight alpaca preference pairs (chosen: the expected answer), preprocessed."""
    d = tmp_path_factory.mktemp("pairs")
    src = write_jsonl(str(d / "p.jsonl"), pairwise_records(8))
    return preprocess(src, str(d / "pairs"), hf_tok, handler="AlpacaStylePairwiseHandler")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Qwen3-MoE (4 experts, top-2) saved as a Hugging Face directory: the same
    weights at every expert-parallel size."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = str(tmp_path_factory.mktemp("moe"))
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=768, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                         decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Qwen2 (fp32) saved as a Hugging Face directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = str(tmp_path_factory.mktemp("hf"))
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def add_prompts(hf_tok: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two-digit additions with the answer after ``####``, as R1 prompt data."""
    rng = random.Random(0)
    recs = []
    for _ in range(48):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        recs.append({"instruction": f"What is {a} + {b}?", "input": "",
                     "output": f"{a} + {b} = {a + b} #### {a + b}"})  # fmt: skip
    d = tmp_path_factory.mktemp("grpo")
    src = write_jsonl(str(d / "add.jsonl"), recs)
    return preprocess(src, str(d / "add"), hf_tok, handler="R1AlpacaStyleInstructionHandler")


@pytest.fixture(scope="session")
def step_data(hf_tok: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Sixteen 3-step addition chains, preprocessed with ``@`` and ``+``/``-``."""
    return preprocess_steps(step_records(16), str(tmp_path_factory.mktemp("prm") / "steps"), hf_tok)


@pytest.fixture(scope="session")
def tied_qwen4(tmp_path_factory) -> str:
    """A random 4-layer Qwen2 with tied embeddings: two layers per DualPipeV chunk at PP2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = str(tmp_path_factory.mktemp("hf4"))
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d
