"""The optimizer offload (``--swap-optimizer``): states and fp32 main parameters copied to a
host buffer after each step and back before the next; here "device" and "host" are both the
CPU, so the copies run and the losses must not move (bit-equal to the run without it)."""

from __future__ import annotations

import pytest
import torch

from helpers.memory_cases import run_cases


def _bit_equal(ref: dict, got: dict) -> None:
    assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"]
    assert len(set(ref["loss"])) > 1  # training moved


def test_fp32_offload_is_bit_equal(one_process):
    ref, got = one_process["none"][0], one_process["offload"][0]
    _bit_equal(ref, got)
    assert got["offload_copies"] > 0 and ref["offload_copies"] == 0


def test_bf16_main_parameters_and_states_move_bit_equal(one_process):
    ref, got = one_process["bf16-none"][0], one_process["bf16-offload"][0]
    _bit_equal(ref, got)
    # 2 moments + 1 main copy per parameter tensor, out and back at each of 5 steps
    assert got["offload_copies"] >= 5 * 2 * 3


@pytest.mark.slow
def test_distributed_optimizer_offload_at_dp2_bf16():
    layout = dict(distributed_optimizer=True)
    runs = run_cases(2, layout, {"none": {}, "offload": dict(offload=True)}, bf16=True,
                     global_batch_size=4)  # fmt: skip
    for ref, got in zip(runs["none"], runs["offload"], strict=True):
        _bit_equal(ref, got)
        assert got["offload_copies"] > 0


class _Megatronish:
    """The shape of a Megatron optimizer the offload relies on: ``.optimizer`` (torch's),
    ``fp32_from_float16_groups`` (main copies) and ``step()``."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.optimizer = torch.optim.AdamW(params, lr=0.1)
        self.fp32_from_float16_groups = [params]

    def step(self) -> None:
        self.optimizer.step()


def test_the_feature_wraps_megatron_optimizers_and_keeps_state_in_host_buffers():
    from anyspeed.features.memory.feature import _offloaded_optimizer

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(2)]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref, opt = _Megatronish(ref), _offloaded_optimizer(lambda: _Megatronish(mine))()
    for step in range(3):
        for a, b in zip(ref, mine, strict=True):
            a.grad, b.grad = torch.full_like(a, step + 1.0), torch.full_like(b, step + 1.0)
        opt_ref.step()
        opt.step()
        assert all(p.grad is None for p in mine)  # main gradients dropped after the step
        moving = list(opt.offload.tensors())
        assert len(moving) == 3 * len(mine)  # two moments and the main copy each
        buffers = {b.untyped_storage().data_ptr() for _, b in opt.offload._buffers.values()}
        assert {t.untyped_storage().data_ptr() for t in moving} == buffers
    n = len(mine)  # out at the start; step 1: the mains in, all out; then all in and out
    assert opt.offload.copies == n + (n + 3 * n) + 2 * (3 * n + 3 * n)
    for a, b in zip(ref, mine, strict=True):
        assert torch.equal(a, b)
