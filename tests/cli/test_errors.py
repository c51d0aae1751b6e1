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
