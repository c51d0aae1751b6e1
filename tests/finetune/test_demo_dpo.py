"""``anyspeed demo --dpo``: its preference set (fast), and the whole demo end to end (slow):
the reward accuracy reaches 0.9 within 100 DPO steps on 2 CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_demo_sft import FILES

from anyspeed.demo.dpo import pairs
from anyspeed.demo.instructions import build_instructions


def test_preference_set_prefers_the_expected_answer():
    train = build_instructions(FILES, 400)[:16]
    out = pairs(train)
    assert len(out) >= 12
    expected = {r["instruction"]: r["output"] for r in train}
    outputs_by_kind: dict[str, set[str]] = {}
    for r in train:
        outputs_by_kind.setdefault(r["instruction"].split()[0], set()).add(r["output"])
    for p in out:
        assert p["chosen"] == expected[p["instruction"]]
        assert p["rejected"] != p["chosen"]
        assert p["rejected"] in outputs_by_kind[p["instruction"].split()[0]]  # same kind


@pytest.mark.slow
def test_dpo_demo_reaches_reward_accuracy(tmp_path):
    cmd = [sys.executable, "-m", "anyspeed", "demo", "--dpo", "--workdir", str(tmp_path),
           "--corpus-mb", "0.5", "--sft-samples", "16", "--sft-iters", "60",
           "--train-iters", "30"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "dpo-metrics.jsonl"))]
    acc = [r["rewards/accuracies"] for r in rows]
    assert max(acc) >= 0.9 and acc[-1] >= 0.9 and len(acc) == 30
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"] + 0.5
    assert "demo: answer:" in out.stdout
    assert all(line.startswith("anyspeed") for line in out.stderr.splitlines()), out.stderr
