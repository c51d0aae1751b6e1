"""The exact old-policy pass (GRPO's, with autograd on for bit-identical values) holds one
micro-batch's activations at a time: its peak tensor memory over four micro-batches is that
of one. Before the fix each micro-batch's output left the forward with its graph attached and
the schedule kept them: four micro-batches held 3.9x one's peak here, and GRPO-LoRA's peak
was 1.5x SFT-LoRA's on an H200 with only two micro-batches per rollout."""

from __future__ import annotations

from anyspeed.testing import run_distributed
from helpers import task_ranks


def test_exact_pass_peak_does_not_grow_with_micro_batches():
    (out,) = run_distributed(task_ranks.exact_pass_peaks, 1, micro=4, timeout=240)
    one, four = out["peaks"]
    assert out["same"]
    assert four <= 1.1 * one, (one, four)
