"""The SFT demo's instruction set: questions about the Python standard library's public
functions, answered by their own docstrings and signatures (read with ``ast``, never imported).

Every machine has these files and reads them in the same order, so the set needs no network
and is the same on every run of one Python version.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from collections.abc import Iterator

MAX_ANSWER_CHARS = 72  # short answers: the whole sample fits the demo's 128-token context


def _module_name(path: str, stdlib: str) -> str:
    """``os/path.py`` -> ``os.path``, ``json/__init__.py`` -> ``json``."""
    rel = os.path.relpath(path, stdlib)[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _summary(node: ast.FunctionDef) -> str | None:
    """The docstring's first line when it is one short sentence, else None."""
    doc = ast.get_docstring(node)
    line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
    if not (12 <= len(line) <= MAX_ANSWER_CHARS and line.endswith(".") and line[0].isupper()):
        return None
    return line


def _pairs(module: str, node: ast.FunctionDef) -> Iterator[dict]:
    """Up to two alpaca records about one function: what it does, and its signature."""
    name = f"`{module}.{node.name}`"
    summary = _summary(node)
    if summary:
        yield {"instruction": f"What does the function {name} do?", "input": "", "output": summary}
    signature = f"def {node.name}({ast.unparse(node.args)}):"
    if len(signature) <= MAX_ANSWER_CHARS and summary:
        yield {"instruction": f"Write the signature of {name}.", "input": "", "output": signature}


def _candidates(files: list[str]) -> Iterator[dict]:
    """Every record the files give, in file order: public undecorated top-level functions of
    public top-level modules and packages (``json``, not ``json.decoder``: parsing is slow)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for path in files:
        module = _module_name(path, stdlib)
        if not module.isidentifier() or module.startswith("_"):
            continue  # submodules (os.path is posixpath), private modules, non-modules
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.FunctionDef)
                and not node.name.startswith("_")
                and not node.decorator_list
            ):
                yield from _pairs(module, node)


def spread(items: list, n: int) -> list:
    """``n`` items evenly spaced over ``items`` (all of them when there are fewer)."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def build_instructions(files: list[str], limit: int) -> list[dict]:
    """Up to ``limit`` alpaca records (instruction, input, output), spread over ``files``; an
    instruction asked twice (a function defined twice in a module) is kept once."""
    seen: dict[str, dict] = {}
    for rec in _candidates(files):
        seen.setdefault(rec["instruction"], rec)
    return spread(list(seen.values()), limit)


def write_jsonl(path: str, records: list[dict]) -> str:
    """``records`` as one JSON object a line; returns ``path``."""
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)
    return path
