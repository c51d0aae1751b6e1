"""The import graph of ``src/anyspeed`` for the architecture tests: every module, what each
imports (at module level or inside functions; ``if TYPE_CHECKING:`` blocks apart), and the
circles in a graph."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "anyspeed"


def modules() -> dict[str, Path]:
    """Dotted module name -> file (a package by its own name, for its ``__init__``)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _package_of(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def import_statements(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(imported ``anyspeed`` module, names taken from it, line) for every import statement of
    ``path`` that runs (anywhere: module level or in a function; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = _package_of(path, module)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("anyspeed")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("anyspeed"):
                out.append((base, [a.name for a in node.names], node.lineno))
    return out


def runtime_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports when any of its code runs. ``from pkg import name``
    is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        found: set[str] = set()
        for base, names, _ in import_statements(path, module):
            subs = {f"{base}.{n}" for n in names} & set(mods)
            found |= subs
            if len(subs) < len(names) or not names:
                while base not in mods and "." in base:
                    base = base.rsplit(".", 1)[0]
                found.add(base)
        found.discard(module)
        graph[module] = found
    return graph


def cycles(graph: dict[str, list[str]] | dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out
