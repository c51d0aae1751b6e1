"""``anyspeed demo --tools``: its conversations (fast: each question answered with the
calculator, whose call computes the product, and with a guess the verifier does not credit),
and the whole demo (slow): GRPO with the calculator raises the reward (the share of exact
products) by at least 0.3 in 80 steps, in under 10 minutes on 2 CPU processes."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from anyspeed.demo import tools as demo
from anyspeed.stages.common.rl.rewards import gsm8k_flexible
from anyspeed.stages.common.rl.tools import calculator
from helpers import timing


def test_conversations_credit_only_the_tool_path():
    sft, prompts = demo.records()
    assert len(prompts) == demo.QUESTIONS and len(sft) == 2 * demo.QUESTIONS
    for rec in sft[:50]:
        msgs = rec["messages"]
        a, b = map(int, re.findall(r"\d+", msgs[0]["content"]))
        label = f"#### {a * b}"
        final = msgs[-1]["content"]
        if len(msgs) == 4:  # question, call, the tool's answer, the product
            expr = msgs[1]["tool_calls"][0]["function"]["arguments"]["expression"]
            assert calculator(expr) == msgs[2]["content"] == str(a * b)
            assert gsm8k_flexible([""], [final], [label]) == [1.0]
        else:  # a guess
            assert len(msgs) == 2 and gsm8k_flexible([""], [final], [label]) == [0.0]


@pytest.mark.slow
def test_tools_demo_raises_the_reward(tmp_path):
    cmd = [sys.executable, "-m", "anyspeed", "demo", "--tools", "--workdir", str(tmp_path),
           "--corpus-mb", "1"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("demo: reward"))
    r0, r1 = map(float, re.findall(r"\d+\.\d+", line)[:2])
    assert r1 >= r0 + 0.3, line
    assert timing.within(took, 600), took
