"""DPO and SimPO end to end: the first step against transformers' log-probabilities of the
same HF model (policy = reference: loss ln 2), SimPO's loss from transformers' mean token
log-probs by hand, LoRA's reference (the base, adapters off), and micro-batch invariance."""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import read_back

TOL = 1e-5


def hf_pair_logps(
    hf_dir: str, prefix: str
) -> tuple[list[float], list[float], list[int], list[int]]:
    """transformers: each answer's summed log-probability (labels -100 on the prompt), and its
    token count, for every pair, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    out: dict[str, tuple[list[float], list[int]]] = {}
    for side in ("chosen", "rejected"):
        ids = read_back(f"{prefix}_packed_{side}_input_ids_document")
        labels = read_back(f"{prefix}_packed_{side}_labels_document")
        sums, counts = [], []
        with torch.no_grad():
            for i, lab in zip(ids, labels, strict=True):
                logits = model(input_ids=torch.tensor([i])).logits[0, :-1].double()
                y = torch.tensor(lab[1:])
                keep = y != -100
                lp = torch.log_softmax(logits, -1)[keep].gather(1, y[keep, None])
                sums.append(float(lp.sum()))
                counts.append(int(keep.sum()))
        out[side] = (sums, counts)
    return out["chosen"][0], out["rejected"][0], out["chosen"][1], out["rejected"][1]


def cli(hf: str, prefix: str, *extra: str, stage: str = "dpo", iters: int = 2,
        mbs: int = 2, gbs: int = 8) -> list[str]:  # fmt: skip
    return ["--stage", stage, "--is-pairwise-dataset", "--load", hf, "--finetune",
            "--data-path", prefix, "--seq-length", "96", "--micro-batch-size", str(mbs),
            "--global-batch-size", str(gbs), "--train-iters", str(iters), "--lr", "1e-3",
            "--split", "100,0,0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-iters", "0", "--log-interval", "1", "--no-progress-bar", "--seed", "7",
            *extra]  # fmt: skip


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_dpo_first_step_is_ln2_with_transformers_logps(pair_data, tiny_qwen):
    """Policy = reference (both the converted HF model): loss ln 2, rewards 0; the answers'
    summed log-probs are transformers'; the second step has learned (accuracy, margin up)."""
    argv = cli(tiny_qwen, pair_data)
    hist = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    m = hist["metrics"]
    pc, pr, _, _ = hf_pair_logps(tiny_qwen, pair_data)
    assert hist["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert m["logps/chosen"][0] == pytest.approx(mean(pc), rel=TOL)
    assert m["logps/rejected"][0] == pytest.approx(mean(pr), rel=TOL)
    assert abs(m["rewards/margins"][0]) < 1e-6
    assert hist["loss"][1] < hist["loss"][0] and m["rewards/margins"][1] > 0


def test_simpo_first_step_equals_formula_on_transformers_logps(pair_data, tiny_qwen):
    beta, ratio = 2.5, 0.5
    argv = cli(tiny_qwen, pair_data, "--simpo-beta", str(beta), "--gamma-beta-ratio",
               str(ratio), stage="simpo", iters=1)  # fmt: skip
    hist = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    pc, pr, nc, nr = hf_pair_logps(tiny_qwen, pair_data)
    want = []
    for a, b, n, k in zip(pc, pr, nc, nr, strict=True):
        z = beta * (a / n - b / k - ratio)
        want.append(math.log1p(math.exp(-z)))  # -log sigmoid(z)
    assert hist["loss"][0] == pytest.approx(mean(want), rel=TOL)
    acc = mean([float(a / n > b / k) for a, b, n, k in zip(pc, pr, nc, nr, strict=True)])
    assert hist["metrics"]["rewards/accuracies"][0] == pytest.approx(acc)


def test_dpo_lora_reference_is_the_base(pair_data, tiny_qwen):
    """DPO-LoRA: the reference is the base with adapters off (no copy): the first step is
    ln 2, and after the adapters move the policy differs from it (the margin grows)."""
    argv = cli(tiny_qwen, pair_data, "--lora-target-modules", "linear_qkv", "linear_fc1",
               "--lora-r", "4", iters=3)  # fmt: skip
    hist = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    assert hist["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    margins = hist["metrics"]["rewards/margins"]
    assert margins[0] == pytest.approx(0, abs=1e-6) and margins[2] > margins[1] > 0


@pytest.mark.slow  # 46 s; the global pair mean is also checked by the verify rows (CI time)
def test_micro_batch_1x8_equals_8x1(pair_data, tiny_qwen):
    """The loss is the global pair mean: one micro-batch of 8 pairs and eight of 1 give the
    same loss and grad norm, step after step."""
    runs = [cli(tiny_qwen, pair_data, mbs=m, iters=3) for m in (8, 1)]
    out = run_distributed(sft_ranks.posttrain_many, 1, argv=runs[0], clis=runs, timeout=300)[0]
    assert out[0]["loss"] == pytest.approx(out[1]["loss"], rel=TOL)
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=TOL)
