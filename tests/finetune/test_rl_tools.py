"""The tools of multi-turn rollouts, each against plain Python: hermes-style call parsing, the
calculator (arithmetic only), argument checks from the JSON schema, truncation at each side,
and hostile calls (malformed JSON, an unknown tool, wrong argument types, a tool that raises
or never returns, code that writes outside its directory or opens a socket), each answered
with an error message and counted, never raised."""

from __future__ import annotations

import json
import os
import time

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.common.rl import tools as T


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def sleeps(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def raises(x: str) -> str:
    """Fail.

    Args:
        x: anything
    """
    raise RuntimeError(f"bad {x}")


def box(*names: str, timeout: float = 5.0, chars: int = 64, side: str = "left") -> T.Toolbox:
    return T.Toolbox([f"{__name__}:{n}" if n not in T.BUILTINS else n for n in names],
                     timeout, chars, side)  # fmt: skip


def test_parse_hermes_calls():
    text = ('I will call.<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n'
            '</tool_call><tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
            '\\"1+2\\"}"}</tool_call>')  # fmt: skip
    calls = T.parse_calls(text)
    assert calls == [T.Call("multiply", {"a": 3, "b": 4}), T.Call("calculator",
                     {"expression": "1+2"})]  # fmt: skip
    assert T.parse_calls("no call here") == []
    assert T.parse_calls("<tool_call>{oops}</tool_call>")[0].error.startswith("malformed")
    assert T.parse_calls('<tool_call>{"name": 1}</tool_call>')[0].error
    assert T.parse_calls('<tool_call>{"name": "x"')[0].error == "unclosed <tool_call>"


@pytest.mark.parametrize("expr", ["123 * 45", "2 ** 10 - 7", "(5 + 3) / 4", "-7 // 2", "17 % 5"])
def test_calculator_equals_python(expr):
    want = eval(expr)  # the reference: Python's own arithmetic
    want = int(want) if isinstance(want, float) and want.is_integer() else want
    assert T.calculator(expr) == str(want)


@pytest.mark.parametrize("expr", ["__import__('os')", "open('x')", "a + 1", "9 ** 9 ** 9"])
def test_calculator_refuses_what_is_not_arithmetic(expr):
    got = box("calculator").answer(T.Call("calculator", {"expression": expr}))
    assert got.error and "error" in json.loads(got.text)


def test_a_tool_answers_and_its_schema_comes_from_its_docstring():
    b = box("multiply")
    assert b.schemas["multiply"]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    got = b.answer(T.Call("multiply", {"a": 123, "b": 45}))
    assert got.text == "5535" and not got.error and got.seconds >= 0


@pytest.mark.parametrize(("call", "says"), [
    (T.Call("", {}, "malformed tool call JSON (x)"), "malformed"),
    (T.Call("divide", {"a": 1}), "unknown tool 'divide'"),
    (T.Call("multiply", {"a": "3", "b": 4}), "argument 'a' must be integer"),
    (T.Call("multiply", {"a": True, "b": 4}), "argument 'a' must be integer"),
    (T.Call("multiply", {"a": 3}), "missing argument 'b'"),
    (T.Call("multiply", {"a": 3, "b": 4, "c": 5}), "unknown argument 'c'"),
    (T.Call("raises", {"x": "y"}), "RuntimeError: bad y"),
], ids=["json", "unknown", "type", "bool", "missing", "extra", "raises"])  # fmt: skip
def test_hostile_calls_are_error_answers(call, says):
    got = box("multiply", "raises").answer(call)
    assert got.error and not got.timeout
    assert says in json.loads(got.text)["error"]


def test_a_tool_that_never_returns_times_out():
    t0 = time.perf_counter()
    got = box("sleeps", timeout=0.5).answer(T.Call("sleeps", {"seconds": 3600}))
    assert got.error and got.timeout and time.perf_counter() - t0 < 5


@pytest.mark.parametrize(("side", "want"), [
    ("left", "0123456789...(truncated)"),
    ("right", "(truncated)...mnopqrstuv"),
    ("middle", "01234...(truncated)...rstuv"),
])  # fmt: skip
def test_truncation_sides(side, want):
    assert box(chars=10, side=side).clip("0123456789abcdefghijklmnopqrstuv") == want


def test_code_runs_contained():
    """The python tool prints; a write outside its directory and a socket fail inside it."""
    b = box("python", timeout=20)
    ok = b.answer(T.Call("python", {"code": "print(6 * 7)"}))
    assert ok.text.strip() == "42" and not ok.error
    write = b.answer(T.Call("python", {"code": "open('/tmp/anyspeed-tool-escape', 'w')"}))
    assert "error" in write.text and not os.path.exists("/tmp/anyspeed-tool-escape")
    sock = b.answer(
        T.Call("python", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 80), 2)"})
    )
    assert "error" in sock.text


def test_bad_tool_names_are_one_line():
    with pytest.raises(UsageError, match="--tools: unknown tool 'nope'"):
        T.resolve("nope")
    with pytest.raises(UsageError, match="cannot import"):
        T.resolve("no_such_module_x:f")
