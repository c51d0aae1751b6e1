"""``anyspeed pretrain --use-torch-fsdp2``: Megatron-Core's TorchFullyShardedDataParallel on
every device. Loss and grad norm equal DDP with the distributed optimizer for 4 steps, at DP2
and TP2 (+SP) x DP2; each rank holds half of DDP's parameters, gradients and optimizer state
(measured on the ranks' own tensors)."""

from __future__ import annotations

import pytest
from test_pretrain import _close, base_args, run_many, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_corpus(str(tmp_path_factory.mktemp("fsdp2_corpus") / "c"))


def _args(corpus: str, *extra: str) -> list[str]:
    args = base_args(corpus, 4) + ["--untie-embeddings-and-output-weights", "--eval-iters", "0"]
    return [*args, *extra]


def test_dp2_equals_distributed_optimizer_and_halves_the_state(corpus: str) -> None:
    fsdp, distopt, ddp = run_many(
        2,
        [
            _args(corpus, "--use-torch-fsdp2"),
            _args(corpus, "--use-distributed-optimizer"),
            _args(corpus),
        ],
    )
    _close(fsdp["loss"], distopt["loss"])
    _close(fsdp["grad_norm"], distopt["grad_norm"])
    for key in ("params", "grads", "optimizer"):
        half = ddp["state_bytes"][key] / 2
        assert fsdp["state_bytes"][key] == pytest.approx(half, rel=0.02), key


@pytest.mark.slow
def test_tp2_sp_dp2_equals_distributed_optimizer(corpus: str) -> None:
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    fsdp, distopt = run_many(
        4,
        [
            _args(corpus, *tp, "--use-torch-fsdp2"),
            _args(corpus, *tp, "--use-distributed-optimizer"),
        ],
    )
    _close(fsdp["loss"], distopt["loss"])
    _close(fsdp["grad_norm"], distopt["grad_norm"])
