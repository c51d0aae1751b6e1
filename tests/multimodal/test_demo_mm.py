"""``anyspeed demo --mm`` end to end on 2 processes (DP2): drawn pictures and captions, a tiny
HF LLaVA, ``posttrain --stage vlm``, greedy captions of held-out pictures. The caption loss must
fall by at least half in 200 steps; the CI run takes 60 steps (the same check)."""

from __future__ import annotations

import pytest

from anyspeed.demo import main


def _run(tmp_path, capsys, iters: int) -> str:
    rc = main(["--mm", "--workdir", str(tmp_path), "--train-iters", str(iters)])
    out = capsys.readouterr().out
    assert rc == 0, out
    return out


def test_demo_mm_short(tmp_path, capsys):
    out = _run(tmp_path, capsys, 60)
    assert "at least 50%, OK" in out and "held-out captions exactly right" in out


@pytest.mark.slow
def test_demo_mm_200_steps_captions_held_out_pictures(tmp_path, capsys):
    out = _run(tmp_path, capsys, 200)
    right = int(out.split("exactly right: ")[1].split("/")[0])
    assert right >= 8  # of 32: well above chance (1 in 30 captions)
