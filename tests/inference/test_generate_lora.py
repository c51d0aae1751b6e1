"""``anyspeed generate --lora-load``: a LoRA checkpoint's adapters folded into the ``--load``
base (MindSpeed-LLM's inference flags). Reference: transformers' greedy generation from the
merged export ``anyspeed convert --lora-load`` writes (whose logits equal the adapted
Megatron model's: ``tests/finetune/test_lora_convert_quick.py``)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_infer_cli import _cli, _error

from anyspeed.commands import generate
from anyspeed.commands.convert import main as convert
from helpers import lora_ranks
from helpers.convert_ranks import tiny_hf_model

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory, hf_tok: str) -> dict:
    d = tmp_path_factory.mktemp("gen_lora")
    hf = d / "hf"
    tiny_hf_model(hf, "tiny-qwen2.5", seed=1, vocab_size=600)
    for name in os.listdir(hf_tok):
        shutil.copy(os.path.join(hf_tok, name), hf / name)
    base, lora, merged = str(d / "base"), str(d / "lora"), str(d / "merged")
    to_mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf)]
    assert convert([*to_mg, "--save-dir", base]) == 0
    tokens = torch.zeros(1, 4, dtype=torch.long)
    lora_ranks.adapter_checkpoint(base, lora, TARGETS, 4, 8.0, tokens, b_std=0.5)
    to_hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", base]
    assert (
        convert([*to_hf, "--save-dir", merged, "--lora-load", lora, "--hf-cfg-dir", str(hf)]) == 0
    )
    return {"hf": str(hf), "base": base, "lora": lora, "merged": merged}


def _greedy(hf_dir: str, tok_dir: str, n: int = 16) -> str:
    """transformers' greedy continuation of PROMPT (ids past the tokenizer suppressed, as
    anyspeed never picks the padded vocabulary's rows)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = tok(PROMPT)["input_ids"]
    vocab = model.config.vocab_size
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0,
                         suppress_tokens=list(range(len(tok), vocab)))  # fmt: skip
    return tok.decode(out[0, len(ids) :])


def test_generate_with_lora_equals_the_merged_model(ckpts, capsys):
    argv = ["--load", ckpts["base"], "--lora-load", ckpts["lora"], "--tokenizer-name-or-path",
            ckpts["hf"], "--prompt", PROMPT, "--max-new-tokens", "16", "--lora-r", "4",
            "--lora-target-modules", *TARGETS, "--lora-fusion"]  # fmt: skip
    assert generate.main(argv) == 0
    out = capsys.readouterr().out
    want = _greedy(ckpts["merged"], ckpts["hf"])
    assert f"prompt: {PROMPT}\n{want}\n" in out
    assert want != _greedy(ckpts["hf"], ckpts["hf"])  # the adapters change the answer


def test_lora_flags_are_checked_in_one_line(ckpts, capsys):
    base = ["--load", ckpts["base"], "--tokenizer-name-or-path", ckpts["hf"], "--prompt", "hi"]
    cases = [
        ([*base, "--lora-load", ckpts["lora"], "--lora-r", "8"], "was trained with --lora-r 4"),
        ([*base, "--lora-load", ckpts["base"]], "not a LoRA checkpoint"),
        ([*base, "--lora-alpha", "8"], "--lora-alpha describes a LoRA checkpoint"),
    ]
    for argv, message in cases:
        err = _error(capsys, generate.main, argv)
        assert message in err, (argv, err)


@pytest.mark.slow
def test_generate_with_lora_at_tp2(ckpts: dict) -> None:
    res = _cli("generate", "--load", ckpts["base"], "--lora-load", ckpts["lora"],
               "--tokenizer-name-or-path", ckpts["hf"], "--prompt", PROMPT,
               "--max-new-tokens", "16", "--tensor-model-parallel-size", "2")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"prompt: {PROMPT}\n{_greedy(ckpts['merged'], ckpts['hf'])}\n" in res.stdout
    assert all(x.startswith("anyspeed") for x in res.stderr.splitlines()), res.stderr
