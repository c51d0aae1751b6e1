"""``--o2-optimizer`` (MindSpeed-LLM's): Adam's moments stored in bf16. The step equals AdamW
written out here in plain PyTorch with its moments rounded to bf16 after each step; a run with
it keeps half the optimizer bytes of the fp32-moment run and trains as it does within bf16's
rounding; at the distributed optimizer too."""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.features.memory.o2 import BF16MomentAdam, BF16MomentAdamW
from helpers.memory_cases import run_cases


def _reference(p0, grads, lr, betas, eps, wd, decoupled):
    """AdamW (decoupled) or Adam with L2 decay in fp32 (torch's single-tensor order of
    operations); the moments are stored rounded to bf16, the step uses them unrounded."""
    b1, b2 = betas
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m_new = m.lerp(g, 1 - b1)
        v_new = v.mul(b2).addcmul(g, g, value=1 - b2)
        p = p - lr / (1 - b1**t) * m_new / (v_new.sqrt() / math.sqrt(1 - b2**t) + eps)
        m, v = m_new.bfloat16().float(), v_new.bfloat16().float()
    return p, m, v


@pytest.mark.parametrize("cls", [BF16MomentAdamW, BF16MomentAdam])
def test_the_step_is_adam_with_bf16_moments(cls):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(257, generator=g)
    grads = [torch.randn(257, generator=g) for _ in range(5)]
    param = torch.nn.Parameter(p0.clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = cls([param], **kw)
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    state = opt.state[param]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    want_p, want_m, want_v = _reference(p0, grads, kw["lr"], kw["betas"], kw["eps"],
                                        kw["weight_decay"], cls.decoupled)  # fmt: skip
    torch.testing.assert_close(state["exp_avg"].float(), want_m, rtol=0, atol=0)
    torch.testing.assert_close(state["exp_avg_sq"].float(), want_v, rtol=0, atol=0)
    torch.testing.assert_close(param.detach(), want_p, rtol=1e-6, atol=1e-6)
    # fp32 moments (torch's own AdamW) land elsewhere: the moments really are rounded
    ref = torch.nn.Parameter(p0.clone())
    torch_opt = (torch.optim.AdamW if cls.decoupled else torch.optim.Adam)([ref], **kw)
    for grad in grads:
        ref.grad = grad.clone()
        torch_opt.step()
    assert 0 < (ref - param).abs().max() < 1e-3


CASES = {
    "fp32": {},
    "o2": dict(argv=["--o2-optimizer"]),
    "fp32-distopt": dict(layout=dict(distributed_optimizer=True)),
    "o2-distopt": dict(argv=["--o2-optimizer"], layout=dict(distributed_optimizer=True)),
}


@pytest.fixture(scope="module")
def runs():
    return run_cases(1, {}, CASES)


@pytest.mark.parametrize("kind", ["", "-distopt"])
def test_half_the_optimizer_bytes_and_the_same_training(runs, kind):
    ref, o2 = runs["fp32" + kind][0], runs["o2" + kind][0]
    moments = 2 * ref["param_bytes"]  # two fp32 moments per fp32 parameter
    assert ref["optimizer_bytes"] - o2["optimizer_bytes"] == moments // 2
    assert o2["loss"][0] == ref["loss"][0]  # the first forward precedes any step
    assert o2["loss"] == pytest.approx(ref["loss"], rel=1e-3)
    assert o2["loss"] != ref["loss"]  # the rounded moments show


def _losses(out: str) -> list[str]:
    import re

    return re.findall(r"iteration +\d+/ *\d+ .*?lm loss: ([0-9.E+-]+)", out)


@pytest.mark.slow  # three process runs; the step and the bytes are checked in CI above
@pytest.mark.parametrize("distopt", [[], ["--use-distributed-optimizer"]])
def test_resumed_run_equals_the_straight_one(tmp_path, distopt):
    """Saved at step 2 with bf16 moments, resumed: steps 3-4 equal the run that never
    stopped (the moments load as saved and stay bf16)."""
    import subprocess
    import sys

    argv = ["--model", "tiny-qwen2.5", "--mock-data", "--vocab-size", "512", "--seq-length",
            "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--log-interval", "1", "--no-progress-bar", "--seed", "3", "--train-iters", "4",
            "--o2-optimizer", *distopt]  # fmt: skip

    def run(*extra: str) -> list[str]:
        cmd = [sys.executable, "-m", "anyspeed", "pretrain", *argv, *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return _losses(out.stdout + out.stderr)

    straight = run()
    run("--save", "ck", "--save-interval", "2", "--exit-interval", "2")
    assert run("--load", "ck")[-2:] == straight[-2:] and len(straight) == 4
