"""Distillation over the teacher's top-k (``--distill-update topk``): the vocabulary-parallel
top-k and log-probabilities at given ids, and their gradient, equal plain PyTorch on the whole
logits at TP1 and TP2; the loss over all of the vocabulary is torch's KL(teacher || student);
the teacher's top-k in a rollout equals transformers'; a teacher that is the student gives a
loss and a gradient of 0."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_distill import cli, hf_logps, teacher  # noqa: F401 - the teacher fixture

from anyspeed.stages.distill.loss import topk_forward_kl
from anyspeed.testing import run_distributed
from helpers import distill_ranks, sft_ranks
from helpers.instruction import VOCAB

TOL = 1e-5


def test_the_loss_over_every_token_is_torchs_forward_kl():
    g = torch.Generator().manual_seed(0)
    s, t = (torch.log_softmax(torch.randn(3, 4, 50, generator=g) * 2, -1) for _ in range(2))
    want = F.kl_div(s, t, reduction="none", log_target=True).sum(-1)  # KL(t || s)
    torch.testing.assert_close(topk_forward_kl(s, t), want, atol=1e-6, rtol=0)
    top = t.topk(5, -1).indices  # over the top 5 only: the rest of the teacher's mass left out
    part = (t.gather(-1, top).exp() * (t.gather(-1, top) - s.gather(-1, top))).sum(-1)
    torch.testing.assert_close(topk_forward_kl(s.gather(-1, top), t.gather(-1, top)), part)


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_topk_and_logprobs_equal_plain_torch(tp):
    k = 6
    got = run_distributed(distill_ranks.topk_logprobs, tp, k=k, timeout=120)
    g = torch.Generator().manual_seed(11)
    full = torch.randn(5, 2, 40, generator=g) * 3
    full[..., 37:] = float("-inf")
    weights = torch.rand(5, 2, k, generator=g)
    full.requires_grad_()
    ids = full.detach().topk(k, -1).indices
    lp = torch.log_softmax(full, -1).gather(-1, ids)
    (weights * lp).sum().backward()
    for rank, r in enumerate(got):
        assert r["ids"] == ids.tolist()
        torch.testing.assert_close(torch.tensor(r["logp"]), lp.detach(), atol=TOL, rtol=0)
        want = full.grad.chunk(tp, -1)[rank]
        torch.testing.assert_close(torch.tensor(r["grad"]), want, atol=TOL, rtol=0)


def test_the_rollouts_teacher_topk_equals_transformers(
    add_prompts,
    tiny_qwen,
    hf_tok,
    teacher,  # noqa: F811 - the fixture
    tmp_path,
):
    """At TP2: the teacher's 8 likeliest tokens at every answer position and their
    log-probabilities are transformers'; no advantage without a reward."""
    from transformers import AutoModelForCausalLM

    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, "--distill-update", "topk",
               "--distill-topk", "8", "--tensor-model-parallel-size", "2",
               "--save", str(tmp_path / "r"))  # fmt: skip
    got = run_distributed(sft_ranks.distill_rollout, 2, argv=argv, cli=argv,
                          rows=list(range(4)), timeout=300)  # fmt: skip
    micro = got[-1]
    assert micro is not None and got[0] == micro
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    for b, labels_lp in zip(micro, hf_logps(teacher, micro), strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor(b["tokens"])).logits, -1)
        mask = torch.tensor(b["loss_mask"]) > 0
        top = lp.topk(8, -1)
        close = {"atol": TOL, "rtol": 0}
        torch.testing.assert_close(torch.tensor(b["teacher_top_logp"])[mask],
                                   top.values[mask], **close)  # fmt: skip
        ids = torch.tensor(b["teacher_ids"])[mask]  # ties aside, the same ids: their values
        torch.testing.assert_close(lp[mask].gather(-1, ids), top.values[mask], **close)
        torch.testing.assert_close(torch.tensor(b["teacher_logp"])[mask], labels_lp[mask], **close)
        assert torch.tensor(b["advantages"])[mask].abs().max() == 0


def test_a_teacher_that_is_the_student_gives_no_loss(add_prompts, tiny_qwen, hf_tok):
    """Over every token of the vocabulary, KL(student || student) is 0 and so is its gradient,
    sum_k p(k) grad log p(k) = grad sum_k p(k)."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, tiny_qwen, "--distill-update", "topk",
               "--distill-topk", str(VOCAB), iters=1)  # fmt: skip
    (hist,) = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)
    assert hist["loss"] == pytest.approx([0.0], abs=1e-6)
    assert hist["grad_norm"] == pytest.approx([0.0], abs=1e-5), hist["grad_norm"]


def test_topk_refuses_a_sampled_token_estimator(
    capsys,
    add_prompts,
    tiny_qwen,
    hf_tok,
    teacher,  # noqa: F811 - the fixture
):
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, "--distill-update", "topk",
               "--distill-kl", "mse")  # fmt: skip
    assert posttrain(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("anyspeed: ")]
    assert len(err) == 1 and "drop --distill-kl" in err[0], err
