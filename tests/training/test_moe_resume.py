"""``anyspeed pretrain`` with experts: a run saved at one expert layout resumes at another.

A one-process run of a tiny Qwen3-MoE model (aux and z losses on, no token dropping) saves its
initial weights and trains 5 iterations uninterrupted: the reference. An EP2 run with the
distributed optimizer starts from the same weights, saves at iteration 3 and exits; resuming
that checkpoint (model, optimizer and data position) at EP1 x DP2 and at TP2 (experts split by
tensor parallelism instead) must continue the reference's losses and grad norms within 1e-5
(fp32). EP2 x TP2 on four processes runs with ``-m slow``.
"""

from __future__ import annotations

import pytest
from test_pretrain import _close, base_args, run_many, write_corpus

pytestmark = pytest.mark.slow  # two process groups

MOE = ["--model", "tiny-qwen3-moe", "--num-layers", "2", "--num-experts", "8",
       "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001"]  # fmt: skip
EP2 = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
RESUMES = {
    "ep2->ep1-dp2": ["--use-distributed-optimizer"],
    "ep2->tp2-sp": [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--use-distributed-optimizer",
    ],
}


def _args(prefix: str, iters: int, *extra: str) -> list[str]:
    argv = base_args(prefix, iters)
    del argv[argv.index("--model") : argv.index("--model") + 4]  # the dense preset and its depth
    return argv + MOE + list(extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_resume")
    prefix = write_corpus(str(root / "corpus_text_document"), docs=200)
    init, ck = str(root / "init"), str(root / "ep2")
    _, ref = run_many(1, [
        _args(prefix, 0, "--save", init),
        _args(prefix, 5, "--load", init, "--finetune"),
    ])  # fmt: skip
    saved, *resumed = run_many(2, [
        _args(prefix, 5, *EP2, "--load", init, "--finetune", "--save", ck, "--save-interval",
              "3", "--exit-interval", "3"),
        *[_args(prefix, 5, *flags, "--load", ck) for flags in RESUMES.values()],
    ])  # fmt: skip
    return ref, saved, dict(zip(RESUMES, resumed, strict=True)), (prefix, ck)


def test_ep2_run_matches_single_process(runs):
    ref, saved, _, _ = runs
    assert saved["iterations"] == [1, 2, 3]
    _close(saved["loss"], ref["loss"][:3])
    _close(saved["grad_norm"], ref["grad_norm"][:3])


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_at_new_expert_layout(runs, name):
    ref, _, resumed, _ = runs
    hist = resumed[name]
    assert hist["iterations"] == [4, 5]
    _close(hist["loss"], ref["loss"][3:])
    _close(hist["grad_norm"], ref["grad_norm"][3:])


@pytest.mark.slow  # four processes
def test_resume_at_ep2_tp2(runs):
    ref, _, _, (prefix, ck) = runs
    flags = [*EP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    (hist,) = run_many(4, [_args(prefix, 5, *flags, "--load", ck)])
    assert hist["iterations"] == [4, 5]
    _close(hist["loss"], ref["loss"][3:])
    _close(hist["grad_norm"], ref["grad_norm"][3:])
