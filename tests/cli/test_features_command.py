"""``anyspeed features`` checks its training flags as ``anyspeed pretrain`` does: an unknown or
misspelled flag, a bad value or a number out of range is one line and exit 2 (it was exit 0
with the flag silently ignored)."""

from __future__ import annotations

import pytest

from anyspeed.cli import main


@pytest.mark.parametrize(("argv", "needle"), [
    (["--no-such-flag"], "unsupported flag --no-such-flag"),
    (["--optimisation-level", "1"], "did you mean --optimization-level?"),
    (["--json", "--tensor-model-paralel-size", "2"], "did you mean --tensor-model-parallel-size?"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1 (got 0)"),
    (["--micro-batch-size", "two"], "argument --micro-batch-size: invalid int value: 'two'"),
])  # fmt: skip
def test_bad_training_flags_are_one_line(capsys, argv, needle):
    assert main(["features", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("anyspeed features: error:")
    assert needle in captured.err


def test_known_flags_still_report(capsys):
    """pretrain's flags and a preset pass; the report follows."""
    assert main(["features", "--model", "tiny-qwen2.5", "--optimization-level", "0",
                 "--micro-batch-size", "2"]) == 0  # fmt: skip
    assert "device-compat" in capsys.readouterr().out
