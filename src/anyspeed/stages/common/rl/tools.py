"""Tools a policy calls in its rollouts (``--tools``): Python functions named ``module:function``
and two built-ins, ``calculator`` (arithmetic, parsed, never evaluated as Python) and ``python``
(a code interpreter run in the HumanEval sandbox: no network, no writes outside its own
directory, time and memory limits). Each tool's JSON schema comes from its signature and
docstring (transformers' ``get_json_schema``, the schema chat templates render).

A call never crashes the run: malformed JSON, an unknown tool, wrong arguments, an exception,
a call past ``--tool-timeout`` and an overlong answer each come back as the tool's answer (an
error message, or the text truncated to ``--max-tool-response-length`` characters at
``--tool-response-truncate-side``, verl's and MindSpeed-RL's meaning: ``left`` keeps the
beginning) and are counted.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from anyspeed.errors import UsageError

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN = "<tool_call>"
SIDES = ("left", "middle", "right")
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "123 * 45"
    """
    value = _arith(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _arith(node: ast.AST) -> int | float:
    """The value of an arithmetic syntax tree; ValueError on anything else (names, calls)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _arith(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("power too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def python(code: str) -> str:
    """Run Python code and return what it printed.

    Args:
        code: a Python program; print the values you need
    """
    from anyspeed.inference.eval.execution import run_program

    out = run_program("tool", code, timeout=_PYTHON_TIMEOUT[0], memory_bytes=512 << 20)
    if out.passed:
        return out.output
    return f"{out.output}error: {out.reason}"


_PYTHON_TIMEOUT = [5.0]  # the sandbox's own limit: --tool-timeout, set by the toolbox
BUILTINS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}


@dataclass(frozen=True)
class Call:
    """One parsed tool call: its name and arguments, or why it could not be parsed."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_calls(text: str) -> list[Call]:
    """The hermes-style calls in an answer (``<tool_call>{"name": ..., "arguments": ...}
    </tool_call>``, as chat templates render them); a malformed one is a Call with ``error``."""
    calls = []
    for body in CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(Call("", {}, f"malformed tool call JSON ({exc.msg})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(Call("", {}, 'a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(Call(obj["name"], {}, "the arguments must be a JSON object"))
            continue
        calls.append(Call(obj["name"], args))
    if not calls and OPEN in text:
        calls.append(Call("", {}, "unclosed <tool_call>"))
    return calls


@dataclass
class Answer:
    """A tool's answer to one call, with what the metrics count."""

    name: str
    text: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0


def resolve(name: str) -> Callable[..., Any]:
    """A tool by its ``--tools`` name: a built-in or ``module:function`` (UsageError else)."""
    from anyspeed.stages.common.user_code import load_callable

    return load_callable(name, BUILTINS, "--tools", "tool")


def schema(func: Callable[..., Any], flag: str = "--tools") -> dict[str, Any]:
    """The JSON schema of a tool (what the chat template shows the model)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as exc:  # transformers raises its own error types for bad docstrings
        name = getattr(func, "__name__", func)
        raise UsageError(
            f"{flag} {name}: no JSON schema from its signature and docstring ({exc}); give "
            "every argument a type hint and an Args: line"
        ) from None


class Toolbox:
    """The run's tools by name, with their limits; :meth:`answer` runs one call."""

    def __init__(self, names: list[str], timeout: float, max_chars: int, side: str) -> None:
        self.funcs: dict[str, Callable[..., Any]] = {}
        self.schemas: dict[str, dict[str, Any]] = {}
        for n in names:
            func = resolve(n)
            s = schema(func)
            self.funcs[s["function"]["name"]], self.schemas[s["function"]["name"]] = func, s
        self.timeout, self.max_chars, self.side = timeout, max_chars, side
        _PYTHON_TIMEOUT[0] = timeout

    def answer(self, call: Call) -> Answer:
        """Run ``call``: its answer, an error message when it cannot run or fails."""
        func = self.funcs.get(call.name)
        wrong = call.error
        if wrong is None and func is None:
            wrong = f"unknown tool {call.name!r}; the tools are {', '.join(sorted(self.funcs))}"
        if wrong is None:
            params = self.schemas[call.name]["function"].get("parameters", {})
            wrong = check_arguments(params, call.arguments)
        if wrong is not None or func is None:
            return Answer(call.name, self.error(wrong or ""), error=True)
        t0 = time.perf_counter()
        done, value, exc = _within(func, call.arguments, self.timeout)
        seconds = time.perf_counter() - t0
        if not done:
            msg = f"the tool did not answer within {self.timeout:g}s"
            return Answer(call.name, self.error(msg), True, True, seconds)
        if exc is not None:
            return Answer(
                call.name, self.error(f"{type(exc).__name__}: {exc}"), True, False, seconds
            )
        return Answer(call.name, self.clip(str(value)), seconds=seconds)

    def error(self, message: str) -> str:
        """An error answer: a JSON object whose message is cut as answers are."""
        return json.dumps({"error": self.clip(message)})

    def clip(self, text: str) -> str:
        """``text`` cut to ``max_chars`` characters at the configured side."""
        n = self.max_chars
        if len(text) <= n:
            return text
        if self.side == "left":
            return text[:n] + "...(truncated)"
        if self.side == "right":
            return "(truncated)..." + text[-n:]
        return text[: n // 2] + "...(truncated)..." + text[len(text) - n // 2 :]


def check_arguments(params: dict[str, Any], args: dict[str, Any]) -> str | None:
    """Why ``args`` do not fit a tool's parameter schema (None when they do)."""
    props = params.get("properties", {})
    for name in params.get("required", []):
        if name not in args:
            return f"missing argument {name!r}"
    for name, value in args.items():
        if name not in props:
            return f"unknown argument {name!r}; the arguments are {', '.join(props) or 'none'}"
        kind = props[name].get("type")
        types = JSON_TYPES.get(kind) if isinstance(kind, str) else None
        wrong_bool = isinstance(value, bool) and kind in ("integer", "number")
        if types and (not isinstance(value, types) or wrong_bool):
            return f"argument {name!r} must be {kind}, not {type(value).__name__}"
    return None


def _within(func: Callable[..., Any], args: dict[str, Any], timeout: float) -> tuple:
    """(finished, value, exception) of ``func(**args)`` run in a daemon thread for at most
    ``timeout`` seconds (a call that never returns is left behind, not waited for)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = func(**args)
        except BaseException as exc:  # a tool's failure is its answer
            box["exc"] = exc

    thread = threading.Thread(target=target, daemon=True, name="anyspeed-tool")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, None, None
    return True, box.get("value"), box.get("exc")
