"""``anyspeed demo --distill``: its teacher data (fast), and the whole demo (slow): the
student's KL to a larger teacher falls with no reward, and its held-out accuracy rises."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from anyspeed.demo import distill, grpo


def test_the_teacher_learns_only_the_credited_form(tmp_path):
    """The teacher's SFT set answers every training question once, in the form the verifier
    credits; the student's (the --grpo demo's) has both forms."""
    train, _ = grpo.task()
    teacher = grpo.sft_records(train, (1, 0))
    assert [r["output"] for r in teacher] == [r["output"] for r in train]
    assert all(grpo.accuracy([r["output"]], [r]) == 1.0 for r in teacher[:20])
    student = grpo.sft_records(train)
    assert any(not r["output"].startswith("#### ") for r in student)
    assert distill.TEACHER_LAYERS > 4


@pytest.mark.slow
def test_distill_demo_lowers_the_kl_and_raises_accuracy(tmp_path):
    cmd = [sys.executable, "-m", "anyspeed", "demo", "--distill", "--workdir", str(tmp_path),
           "--corpus-mb", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("demo: the student's KL"))
    k0, k1, a0, a1, teacher = map(float, re.findall(r"\d+\.\d+", line.replace("5 steps", "")))
    # measured (AVX512 Xeon, 2026-12-06): KL 2.72 -> 0.43, accuracy 0.20 -> 0.74 (teacher 0.81),
    # 312 s in all
    assert k1 < 0.5 * k0 and a1 >= a0 + 0.2 and teacher > a0, line
    assert all(x.startswith("anyspeed") for x in out.stderr.splitlines()), out.stderr
