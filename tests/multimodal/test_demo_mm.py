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


def test_demo_mm_qwen2_5_vl_runs_through(tmp_path, capsys):
    """``--mm --family qwen2_5_vl`` end to end in 20 steps (too few to judge: the slow test)."""
    main(["--mm", "--family", "qwen2_5_vl", "--workdir", str(tmp_path), "--train-iters", "20"])
    out = capsys.readouterr().out
    assert "[4/4] held-out captions exactly right: " in out and "demo finished" in out, out


@pytest.mark.slow
def test_demo_mm_qwen2_5_vl(tmp_path, capsys):
    """``--mm --family qwen2_5_vl``: the loss halves and held-out accuracy rises from 0."""
    rc = main(["--mm", "--family", "qwen2_5_vl", "--workdir", str(tmp_path),
               "--train-iters", "120"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    before, after = out.split("exactly right: ")[1].split(" after")[0].split(" before training, ")
    assert int(before.split("/")[0]) < int(after.split("/")[0])


def test_demo_family_needs_mm(capsys):
    assert main(["--family", "qwen2_vl"]) == 2
    assert "--mm" in capsys.readouterr().err
