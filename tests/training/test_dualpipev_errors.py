"""``--schedules-method dualpipev`` that cannot run stops with one line naming the flag and
what would fix it, before any process group starts."""

from __future__ import annotations

import os

import pytest
from test_pretrain import base_args, write_corpus
from test_pretrain_errors import _error

from anyspeed.stages import prepare

V = ["--schedules-method", "dualpipev"]
PP2 = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data") / "c_text_document"), docs=60)


CASES = {
    "one stage": ([*V], "needs --pipeline-model-parallel-size 2 or more"),
    "vpp": (
        [*PP2, *V, "--num-layers-per-virtual-pipeline-stage", "1"],
        "remove --num-layers-per-virtual-pipeline-stage",
    ),
    "uneven": (
        [*PP2, *V, "--decoder-first-pipeline-num-layers", "3"],
        "under --schedules-method dualpipev: 3/None cannot split --num-layers 4 over 4 stages",
    ),
    "overlap": (
        [*PP2, *V, "--use-distributed-optimizer", "--overlap-grad-reduce"],
        "needs no --overlap-grad-reduce",
    ),
    "param-gather": (
        [*PP2, *V, "--use-distributed-optimizer", "--overlap-param-gather"],
        "needs no --overlap-param-gather",
    ),
    "num-layer-list": ([*PP2, *V, "--num-layer-list", "1,3"], "--num-layer-list counts layers"),
    "layers": ([*PP2, *V, "--num-layers", "6"], "--num-layers 6 is not divisible by 2 x"),
    "micro-batches": (
        [*PP2, *V, "--global-batch-size", "6"],
        "at least 2 x --pipeline-model-parallel-size = 4 micro-batches per step (got 3)",
    ),
    "level": ([*PP2, *V, "--optimization-level", "1"], "needs --optimization-level 2"),
    "dw-detach alone": ([*PP2, "--dualpipev-dw-detach"], "needs --schedules-method dualpipev"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_one_line(capsys, corpus, name):
    extra, want = CASES[name]
    argv = base_args(corpus, 2)
    for flag in ("--num-layers", "--global-batch-size"):  # later values win in argparse
        if flag in extra:
            argv[argv.index(flag) + 1] = extra[extra.index(flag) + 1]
    err = _error(capsys, argv + extra)
    assert want in err, err


def test_stages_without_the_schedule_refuse_it(monkeypatch, corpus):
    """The stages that have not been checked under the V say so (here: pretrain, when
    taken off the list) rather than run Megatron's output-stage assumptions."""
    monkeypatch.setattr(prepare, "DUALPIPEV_STAGES", ("sft",))
    os.environ.pop("WORLD_SIZE", None)
    with pytest.raises(prepare.UsageError, match="not supported in --stage pretrain yet"):
        prepare.prepare(base_args(corpus, 2) + PP2 + V, "launcher")
