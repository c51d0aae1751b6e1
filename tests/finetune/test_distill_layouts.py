"""On-policy distillation at every layout against one process: the student's loss, grad norm
and KL to the teacher (a model of another architecture, split by the same layout) over 4 steps
(two passes over each rollout, so the second has ratios away from 1) equal within 1e-5 at
TP2+SP, PP2 and DP2 (distributed optimizer, each replica rolling out half the prompts), for
the policy-gradient, supervised and top-k updates."""

from __future__ import annotations

import pytest
from test_distill import cli, teacher  # noqa: F401 - the teacher fixture

from anyspeed.testing import run_distributed
from helpers import sft_ranks

pytestmark = pytest.mark.slow

TOL = 1e-5
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
}
RUN = ["--ppo-epochs", "2", "--lr-decay-style", "constant", "--lr", "1e-2"]
UPDATES = ("policy-gradient", "supervised", "topk")


@pytest.fixture(scope="module")
def runs(add_prompts, tiny_qwen, hf_tok, teacher) -> dict[tuple[str, str], dict]:  # noqa: F811
    def argv(update: str, flags: list[str]) -> list[str]:
        return cli(tiny_qwen, add_prompts, hf_tok, teacher, *RUN, "--distill-update", update,
                   *flags, iters=4)  # fmt: skip

    ones = [argv(u, []) for u in UPDATES]
    ref = run_distributed(sft_ranks.posttrain_many, 1, argv=ones[0], clis=ones, timeout=400)[0]
    cases = [(u, name) for u in UPDATES for name in LAYOUTS]
    argvs = [argv(u, LAYOUTS[name]) for u, name in cases]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=900)
    got = {(u, "one"): r for u, r in zip(UPDATES, ref, strict=True)}
    return got | {case: out[0][i] for i, case in enumerate(cases)}


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_grad_norm_and_kl_equal_one_process(runs, update, layout):
    got, want = runs[(update, layout)], runs[(update, "one")]
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    kl = got["metrics"]["distill/reverse_kl"]
    assert kl == pytest.approx(want["metrics"]["distill/reverse_kl"], rel=TOL)
    clip = max(got["metrics"]["actor/pg_clipfrac"])
    assert clip > 0 or update != "policy-gradient"  # ratios off 1


def test_lora_student_rolling_out_at_another_layout(add_prompts, tiny_qwen, hf_tok,
                                                    teacher):  # noqa: F811 - the fixture  # fmt: skip
    """A LoRA student at TP2 rolling out whole on each rank (TP1 x DP2, the adapters merged
    into the moved weights): its rollout log-probs are the training forward's within 1e-5, the
    teacher (a full copy, no adapters) scores them, and the student learns."""
    lora = ["--lora-target-modules", "linear_qkv", "linear_fc2", "--lora-r", "4",
            "--tensor-model-parallel-size", "2", "--infer-tensor-parallel-size", "1",
            "--infer-pipeline-parallel-size", "1", "--infer-expert-parallel-size", "1"]  # fmt: skip
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, *RUN, *lora, iters=4)
    got = run_distributed(sft_ranks.posttrain, 2, argv=argv, cli=argv, timeout=600)
    for hist in got:
        m = hist["metrics"]
        assert max(m["rollout/logp_mismatch_max"]) <= TOL
        assert min(hist["grad_norm"]) > 0.1 and len(m["distill/reverse_kl"]) == 4


def test_resume_is_exact(add_prompts, tiny_qwen, hf_tok, teacher, tmp_path):  # noqa: F811
    """2 steps saved and 2 resumed (the teacher named again, read again) equal 4 straight,
    bit for bit: losses, grad norms and the KL to the teacher."""
    from anyspeed.convert import hf_cache

    ck = str(tmp_path / "ck")
    run = [*RUN, "--distill-update", "topk", "--distill-topk", "8"]
    straight = cli(tiny_qwen, add_prompts, hf_tok, teacher, *run, iters=4)
    first = cli(tiny_qwen, add_prompts, hf_tok, teacher, *run, "--save", ck, "--save-interval",
                "2", iters=2)  # fmt: skip
    resumed = hf_cache.expand(cli(ck, add_prompts, hf_tok, teacher, *run, iters=4), tiny_qwen)
    resumed.remove("--finetune")
    whole, a, b = run_distributed(sft_ranks.posttrain_many, 1, argv=straight,
                                  clis=[straight, first, resumed], timeout=400)[0]  # fmt: skip
    assert a["loss"] + b["loss"] == whole["loss"]
    assert a["grad_norm"] + b["grad_norm"] == whole["grad_norm"]
    kl = "distill/reverse_kl"
    assert a["metrics"][kl] + b["metrics"][kl] == whole["metrics"][kl]
