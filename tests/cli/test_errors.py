"""One usage-error type, one one-line parser and one printer, shared by every command."""

from __future__ import annotations

import pytest

from anyspeed.convert import ConvertError
from anyspeed.data import UsageError as DataUsageError
from anyspeed.errors import OneLineArgumentParser, UsageError, report


def test_parser_raises_one_line_usage_error():
    p = OneLineArgumentParser(prog="anyspeed x")
    p.add_argument("--n", type=int, required=True)
    with pytest.raises(UsageError, match="^argument --n: invalid int value: 'a'$"):
        p.parse_args(["--n", "a"])
    with pytest.raises(UsageError, match="required: --n"):
        p.parse_args([])


def test_parser_raises_a_commands_own_subclass():
    class FlagError(UsageError):
        pass

    class Parser(OneLineArgumentParser):
        error_type = FlagError

    with pytest.raises(FlagError):
        Parser(prog="anyspeed y").parse_args(["--nope"])


def test_report_prints_first_line_and_returns_code(capsys):
    assert report("anyspeed convert", UsageError("bad --flag\nsecond line")) == 2
    assert capsys.readouterr().err == "anyspeed convert: error: bad --flag\n"
    assert report("anyspeed", RuntimeError(""), code=1) == 1
    assert capsys.readouterr().err == "anyspeed: error: RuntimeError\n"


def test_commands_share_the_type():
    assert DataUsageError is UsageError
    assert issubclass(ConvertError, UsageError) and issubclass(UsageError, ValueError)


@pytest.mark.parametrize("value", ["foo", "cuda:0"])
@pytest.mark.parametrize("command", ["convert", "pretrain", "generate"])
def test_a_bad_anyspeed_device_is_one_line_before_any_work(command, value, monkeypatch, capsys):
    """``ANYSPEED_DEVICE`` that torch does not know as a device type: one line and exit 2 (it
    was torch's traceback from inside the command)."""
    from anyspeed import cli

    monkeypatch.setenv("ANYSPEED_DEVICE", value)
    assert cli.main([command, "--load", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"anyspeed: error: ANYSPEED_DEVICE={value}:"), err


def test_a_device_type_torch_knows_is_taken(monkeypatch):
    from anyspeed.device import forced_type

    monkeypatch.setenv("ANYSPEED_DEVICE", " CPU ")
    assert forced_type() == "cpu"
    monkeypatch.delenv("ANYSPEED_DEVICE")
    assert forced_type() == ""
