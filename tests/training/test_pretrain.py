"""``anyspeed pretrain`` on Megatron's GPTDataset: layout parity, exact resume, atomic saves.

A small corpus is written with Megatron's own IndexedDatasetBuilder. A one-process run saves
the initial weights; every run loads them (``--finetune``), so all layouts start equal. Losses
and grad norms of TP2+SP, PP2 and DP2 with the distributed optimizer must match the
one-process run within 1e-5 relative (fp32); resuming (same or another layout) must continue
the uninterrupted run's losses.
"""

from __future__ import annotations

import math
import os

import pytest

from anyspeed.testing import DistributedError, run_distributed
from helpers import pretrain_ranks
from helpers.corpora import write_corpus  # noqa: F401 - the other training tests take it here

RTOL = 1e-5
VOCAB = 500
EOD = VOCAB - 1


def run(world: int, argv: list[str], timeout: float = 300, **kw) -> list[dict]:
    """``anyspeed pretrain ARGV`` on ``world`` spawned ranks; per-rank histories."""
    return run_distributed(pretrain_ranks.pretrain, world, argv=argv, cli=argv, timeout=timeout,
                           **kw)  # fmt: skip


def run_many(world: int, argvs: list[list[str]], timeout: float = 600) -> list[dict]:
    """Several runs in turn in one process group (spawning is the slow part); rank 0's
    history of each."""
    per_rank = run_distributed(pretrain_ranks.pretrain_many, world, argv=argvs[0], clis=argvs,
                               timeout=timeout)  # fmt: skip
    return per_rank[0]


def base_args(prefix: str, iters: int) -> list[str]:
    return [
        "--model", "tiny-qwen2.5", "--num-layers", "4", "--padded-vocab-size", "512",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", str(iters), "--lr", "2e-3", "--lr-warmup-iters", "1",
        "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--weight-decay", "0.1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", prefix,
        "--split", "90,5,5", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
        "--no-progress-bar", "--seed", "7",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    prefix = write_corpus(str(root / "corpus_text_document"))
    init = str(root / "init")
    ref_dir = str(root / "ref")
    _, ref = run_many(1, [
        base_args(prefix, 0) + ["--save", init],
        base_args(prefix, 5) + ["--load", init, "--finetune", "--save", ref_dir,
                                "--save-interval", "3"],
    ])  # fmt: skip
    return root, prefix, init, ref


def _close(got: list[float], want: list[float], rtol: float = RTOL) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isfinite(g), f"step {i}: {g}"
        assert g == pytest.approx(w, rel=rtol), f"step {i}: {g} vs {w}"


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    # Tied embedding and output weights, both on rank 0 in the V; weight gradients deferred.
    "pp2-dualpipev": [
        "--pipeline-model-parallel-size",
        "2",
        "--schedules-method",
        "dualpipev",
        "--dualpipev-dw-detach",
    ],
    "dp2-distopt": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    # MindSpeed's noop slots: the model's 4 layers as 6 slots, stages of 3 and 1 real layers
    "pp2-noop": [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "6",
        "--noop-layers",
        "4,5",
    ],
}


@pytest.fixture(scope="module")
def layout_runs(setup):
    """Each layout trains 3 of 5 iterations from the initial weights and saves (exit at 3)."""
    root, prefix, init, _ = setup
    saves = {name: str(root / f"ck-{name}") for name in LAYOUTS}
    hists = run_many(2, [
        base_args(prefix, 5) + flags + ["--load", init, "--finetune", "--save", saves[name],
                                        "--save-interval", "3", "--exit-interval", "3"]
        for name, flags in LAYOUTS.items()
    ])  # fmt: skip
    return {name: (saves[name], hist) for name, hist in zip(LAYOUTS, hists, strict=True)}


def test_reference_learns(setup):
    _, _, _, ref = setup
    assert ref["iterations"] == [1, 2, 3, 4, 5]
    assert ref["loss"][-1] < ref["loss"][0]
    assert ref["saved"] == [3, 5]
    assert [it for it, _ in ref["valid"]] == [2, 4, 5]
    # Megatron's scheduler: warmup to 2e-3 at the first step, cosine decay towards 1e-4.
    assert ref["lr"][0] == pytest.approx(2e-3)
    assert ref["lr"][1] > ref["lr"][2] > ref["lr"][3] > ref["lr"][4] >= 1e-4


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(setup, layout_runs, name):
    _, _, _, ref = setup
    _, hist = layout_runs[name]
    assert hist["iterations"] == [1, 2, 3]
    _close(hist["loss"], ref["loss"][:3])
    _close(hist["grad_norm"], ref["grad_norm"][:3])
    _close([v for _, v in hist["valid"]], [v for _, v in ref["valid"][:1]])


def test_resume_is_exact(setup):
    """Resuming the reference run's iteration-3 checkpoint reproduces iterations 4 and 5."""
    root, prefix, _, ref = setup
    ck = str(root / "ref")
    # The reference saved iterations 3 and 5; point `latest` back at 3 in a copy.
    import shutil

    copy = str(root / "ref-at-3")
    shutil.copytree(ck, copy)
    shutil.rmtree(os.path.join(copy, "iter_0000005"))
    with open(os.path.join(copy, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("3")
    (hist,) = run(1, base_args(prefix, 5) + ["--load", copy])
    assert hist["iterations"] == [4, 5]
    _close(hist["loss"], ref["loss"][3:], rtol=1e-7)
    _close(hist["grad_norm"], ref["grad_norm"][3:], rtol=1e-7)
    _close(hist["lr"], ref["lr"][3:], rtol=1e-12)


RESUMES = {  # checkpoint written at one layout -> resumed at another (model, optimizer, data)
    "tp2-sp->pp2": ("tp2-sp", LAYOUTS["pp2"]),
    "pp2->dp2": ("pp2", []),
    # Global layer numbers: the V's checkpoint (model, optimizer) resumes without it.
    "pp2-dualpipev->pp2": ("pp2-dualpipev", LAYOUTS["pp2"]),
    "pp2-noop->dp2": ("pp2-noop", []),  # the real layers' numbers: no slots needed to resume
    "dp2-distopt->tp2-sp-distopt": (
        "dp2-distopt",
        LAYOUTS["tp2-sp"] + ["--use-distributed-optimizer"],
    ),
}


@pytest.fixture(scope="module")
def resumed(setup, layout_runs):
    """Every RESUMES case, resumed in one process group."""
    _, prefix, _, _ = setup
    argvs = [base_args(prefix, 5) + flags + ["--load", layout_runs[source][0]]
             for source, flags in RESUMES.values()]  # fmt: skip
    return dict(zip(RESUMES, run_many(2, argvs), strict=True))


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_under_new_layout(setup, resumed, name):
    _, _, _, ref = setup
    hist = resumed[name]
    assert hist["iterations"] == [4, 5]
    _close(hist["loss"], ref["loss"][3:])
    _close(hist["grad_norm"], ref["grad_norm"][3:])


def test_kill_during_save_keeps_previous_checkpoint(setup, tmp_path):
    """A rank killed while writing iteration 4's checkpoint leaves iteration 2 loadable."""
    _, prefix, init, ref = setup
    save = str(tmp_path / "ck")
    argv = base_args(prefix, 5) + ["--load", init, "--finetune", "--save", save,
                                   "--save-interval", "2"]  # fmt: skip
    with pytest.raises(DistributedError, match="exited with code 17"):
        run(1, argv=argv, crash_on_save=2, timeout=240)
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"
    assert os.path.isdir(os.path.join(save, "iter_0000002"))
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    (hist,) = run(1,
                              argv=base_args(prefix, 5) + ["--load", save, "--save", save],
                              timeout=240)  # fmt: skip
    assert hist["iterations"] == [3, 4, 5]
    _close(hist["loss"], ref["loss"][2:], rtol=1e-7)
    assert not os.path.exists(os.path.join(save, "iter_0000004.tmp"))  # cleaned by the next save
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "5"


@pytest.mark.slow  # two more 2-process runs; the suite's time budget
def test_switching_optimizer_kind_needs_no_load_optim(setup, layout_runs):
    """Distributed-optimizer state does not load into the plain optimizer: a clear error."""
    _, prefix, _, ref = setup
    ck, _ = layout_runs["pp2"]
    with pytest.raises(DistributedError, match="saved without --use-distributed-optimizer"):
        run(2, base_args(prefix, 5) + ["--load", ck, "--use-distributed-optimizer"])
    hist = run(2, base_args(prefix, 5) + ["--load", ck, "--use-distributed-optimizer",
                                          "--no-load-optim"])[0]  # fmt: skip
    assert hist["iterations"] == [4, 5]  # weights and data position still resume


def test_fp16_dynamic_loss_scaling(setup):
    """--fp16 starts at a loss scale that overflows: Megatron skips those updates and halves the
    scale until the gradients fit, then trains (loss falls, stays finite)."""
    _, prefix, init, ref = setup
    argv = base_args(prefix, 10) + ["--fp16", "--initial-loss-scale", str(2.0**24),
                                    "--hysteresis", "1", "--load", init, "--finetune"]  # fmt: skip
    (hist,) = run(1, argv)
    assert hist["skipped"], f"an initial scale of 2^24 must overflow fp16 gradients: {hist}"
    assert hist["loss_scale"][-1] < 2.0**24
    assert hist["iterations"][-1] not in hist["skipped"]
    assert all(math.isfinite(x) for x in hist["loss"])
    assert hist["loss"][-1] < hist["loss"][0]
