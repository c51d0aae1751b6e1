"""KV-cache generation and answer-letter scoring at TP1, TP2 and PP2 against no-cache
generation and transformers.

One tiny random Qwen2.5 model (QKV bias, tied embeddings, GQA; vocabulary 600 padded to 640 so
the padded rows must never be chosen) is converted once; one 2-rank process group runs every
layout (TP1 is then two data-parallel copies).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from anyspeed.convert import hf_to_megatron
from anyspeed.testing import run_distributed
from helpers import convert_ranks, infer_ranks
from helpers.eval_fixtures import write_mmlu

NEW = 64
VOCAB = 600  # the shared test tokenizer's
LAYOUT_ARGS = [(1, 1), (2, 1), (1, 2)]
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12], [8, 9, 10, 11]]  # different lengths: padding


def _mmlu_prompts(root, tok) -> tuple[list[list[int]], list[int]]:
    """Few-shot MMLU prompts from a generated fixture, tokenized as ``anyspeed evaluate``
    does, and the answer-letter tokens."""
    from anyspeed.inference.eval import prompts, readers

    write_mmlu(root, {"anatomy": 4, "virology": 3}, shots=2)
    tests = readers.read_choices(str(root), "mmlu", "test")
    dev = readers.read_choices(str(root), "mmlu", "dev")
    texts = [prompts.choice_prompt(q, dev[s][:2]) for s, qs in sorted(tests.items()) for q in qs]
    ids = [tok(t)["input_ids"] for t in texts]
    return ids, [tok(" " + c)["input_ids"][-1] for c in "ABCD"]


# One process group for TP1/TP2/PP2: kept out of CI's time budget (run with -m slow).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, auto_tok) -> dict:
    root = tmp_path_factory.mktemp("gen")
    convert_ranks.tiny_hf_model(root / "hf", "tiny-qwen2.5", seed=1, vocab_size=VOCAB)
    hf_to_megatron(root / "hf", root / "mg", make_vocab_size_divisible_by=128)
    mmlu, letters = _mmlu_prompts(root / "mmlu", auto_tok)
    gen = dict(ckpt=str(root / "mg"), layouts=LAYOUT_ARGS, prompts=PROMPTS, new_tokens=NEW,
               vocab=VOCAB)  # fmt: skip
    choices = dict(ckpt=str(root / "mg"), layouts=LAYOUT_ARGS, prompts=mmlu,
                   candidates=letters, batch_size=3)  # fmt: skip
    ranks = run_distributed(infer_ranks.all_cases, 2, gen=gen, choices=choices, timeout=600)
    return {
        "hf": str(root / "hf"),
        "ranks": [r["gen"] for r in ranks],
        "choices": [r["choices"] for r in ranks],
        "mmlu": mmlu,
        "letters": letters,
    }


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # random weights: run the full budget
    model.generation_config.pad_token_id = 0
    return model


LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_cache_equals_no_cache(runs: dict, layout: str) -> None:
    for rank in runs["ranks"]:  # every rank returns the same tokens
        res = rank[layout]
        assert [len(r) for r in res["greedy_kv1"]] == [NEW] * len(PROMPTS)
        assert res["greedy_kv1"] == res["greedy_kv0"]
        assert res["beam_kv1"] == res["beam_kv0"]
    tokens = [{k: v for k, v in r[layout].items() if not k.startswith("seconds")}
              for r in runs["ranks"]]  # fmt: skip
    assert tokens[0] == tokens[1]


def test_greedy_equals_transformers(runs: dict) -> None:
    model = _hf_model(runs["hf"])
    got = runs["ranks"][0]["tp1pp1"]["greedy_kv1"]
    for prompt, ours in zip(PROMPTS, got, strict=True):
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)  # fmt: skip
        assert ours == ref[0, len(prompt) :].tolist()
    assert max(t for row in got for t in row) < VOCAB


def test_beam_search_equals_transformers(runs: dict) -> None:
    model = _hf_model(runs["hf"])
    ours = runs["ranks"][0]["tp1pp1"]["beam_kv1"]
    ref = model.generate(torch.tensor([PROMPTS[0]]), do_sample=False, num_beams=3,
                         max_new_tokens=len(ours), early_stopping=True)  # fmt: skip
    assert ours == ref[0, len(PROMPTS[0]) :].tolist()


def test_seeded_sampling_is_reproducible_across_runs_and_tp(runs: dict) -> None:
    tp1, tp2 = runs["ranks"][0]["tp1pp1"], runs["ranks"][0]["tp2pp1"]
    assert tp1["sample1"] == tp1["sample2"]
    assert tp1["sample1"] == tp2["sample1"] == runs["ranks"][0]["tp1pp2"]["sample1"]
    assert tp1["sample1"] != tp1["greedy_kv1"]  # it did sample
    assert tp1["beam_sample1"] == tp1["beam_sample2"] == tp2["beam_sample1"]
    assert tp1["beam_sample1"] == runs["ranks"][0]["tp1pp2"]["beam_sample1"]
    assert tp1["beam_sample1"] != tp1["beam_kv1"]  # beam search with sampling did sample


def test_mmlu_choice_equals_transformers_scoring(runs: dict) -> None:
    model = _hf_model(runs["hf"])
    letters = torch.tensor(runs["letters"])
    with torch.no_grad():
        ref = [int(model(torch.tensor([p])).logits[0, -1, letters].argmax()) for p in runs["mmlu"]]
    assert len(set(ref)) > 1  # the random model does not always pick the same letter
    for rank in runs["choices"]:
        for layout in LAYOUTS:
            assert rank[layout] == ref, layout


def test_continuation_likelihood_equals_transformers(runs: dict) -> None:
    """``evaluate``'s likelihood scorer (mmlu_ppl / hellaswag) at every layout, batched and
    left-padded, against transformers' log-softmax of each sequence alone."""
    model = _hf_model(runs["hf"])
    ref = []
    with torch.no_grad():
        for p in runs["mmlu"]:
            logp = model(torch.tensor([p])).logits[0].double().log_softmax(-1)
            ref.append(sum(float(logp[len(p) - 4 + i, t]) for i, t in enumerate(p[-3:])))
    for rank in runs["choices"]:
        for layout in LAYOUTS:
            got = [total for total, _ in rank[f"{layout}-likelihood"]]
            assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-4, layout


FAMILIES = ["tiny-llama2", "tiny-llama3", "tiny-mistral", "tiny-qwen3"]


@pytest.mark.slow
def test_every_family_and_moe(tmp_path: Path) -> None:
    """Every dense family's KV-cache greedy equals no-cache and transformers; an MoE model's
    KV-cache greedy equals its no-cache greedy."""
    ckpts = {}
    for preset in FAMILIES:
        convert_ranks.tiny_hf_model(tmp_path / preset, preset, seed=1)
        hf_to_megatron(tmp_path / preset, tmp_path / f"{preset}-mg")
        ckpts[preset] = str(tmp_path / f"{preset}-mg")
    prompt = [3, 14, 15, 92, 65]
    got = run_distributed(infer_ranks.family_greedy, 1, ckpts=ckpts, new_tokens=32,
                          prompt=prompt, timeout=900)[0]  # fmt: skip
    for preset in FAMILIES:
        kv, no_kv = got[preset]
        ref = _hf_model(str(tmp_path / preset)).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32
        )
        assert kv == no_kv == ref[0, len(prompt) :].tolist(), preset
    assert got["moe"][0] == got["moe"][1] and len(got["moe"][0]) == 32
