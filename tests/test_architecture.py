"""The code's shape, checked: the dependency rule, no import cycle, file and function sizes.

docs/architecture.md states the layers; this test walks every import in ``src/anyspeed`` (also
the ones inside functions) and fails on an import that points upward, on a package-level cycle,
on any anyspeed module importing the user-script shim ``anyspeed.megatron_adaptor``, and on a
file over 400 lines or a function over 80 lines. Inside a package, modules must not import each
other in a circle at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.code_graph import cycles

SRC = Path(__file__).resolve().parents[1] / "src" / "anyspeed"

# A dotted name gives one module of a package a lower layer of its own (the checkpoint
# directory convention, standard library only, is used by features/ and data/ too).
# Lower numbers are lower layers; a module may import its own package and lower layers only.
LAYERS = {
    "errors": 0, "argv": 0, "patching": 0, "launch": 0, "quiet": 0, "checkpoint.files": 0,
    "safe_pickle": 0,
    "device": 1, "layout": 1,
    "distributed": 1.5,  # process groups, rank-0 printing, parallel states, resharding
    "features": 2,
    "adaptor": 3, "models": 3,
    "checkpoint": 4, "data": 4, "inference": 4, "convert": 5, "training": 6,
    "verify": 6.5,  # anyspeed verify's rank hook and gradient comparison, over training
    "stages": 6.5,  # the stage table, command line -> Run, one folder per stage family
    "fsdp": 6.6,  # anyspeed fsdp2: transformers models under FSDP2, over the training loop
    "commands": 7,
    "cli": 7,
    "testing": 8,  # what the tests and Megatron's unit tests run on: ranks, the pool, plugin
    "__main__": 7, "__init__": 7, "megatron_adaptor": 7,
    "demo": 8,  # runs other commands (preprocess, train-tokenizer, pretrain)
}  # fmt: skip
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _unit(module: str) -> str:
    """The unit under ``anyspeed`` that ``module`` belongs to: a module LAYERS names by its
    dotted name, else its top-level package or module."""
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1 and parts[-2] != "anyspeed":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """Every ``anyspeed`` module ``path`` imports, with the line, relative imports resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("anyspeed")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))  # fmt: skip
            if base == "anyspeed":  # "from anyspeed import adaptor": the names are modules
                found += [(f"anyspeed.{a.name}", node.lineno) for a in node.names]
            elif base.startswith("anyspeed"):
                found.append((base, node.lineno))
    return found


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()}
    assert units <= set(LAYERS), f"add {sorted(units - set(LAYERS))} to LAYERS (and the doc)"


def test_imports_point_down():
    bad = []
    for module, path in _modules().items():
        mine = _unit(module)
        for target, line in _imports(path, module):
            theirs = _unit(target)
            if theirs not in LAYERS or theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine] and mine != "__main__":
                bad.append(f"{path.relative_to(SRC)}:{line} ({mine}) imports {target}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_only_the_shim_is_the_shim():
    users = [
        f"{path.relative_to(SRC)}:{line}"
        for module, path in _modules().items()
        for target, line in _imports(path, module)
        if target == "anyspeed.megatron_adaptor"
    ]
    assert not users, f"import the pure anyspeed.adaptor instead: {users}"


def test_no_cycle_between_units():
    graph: dict[str, set[str]] = {}
    for module, path in _modules().items():
        for target, _ in _imports(path, module):
            if _unit(target) != _unit(module):
                graph.setdefault(_unit(module), set()).add(_unit(target))
    seen, stack = set(), []

    def visit(node: str) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join(stack[stack.index(node) :] + [node]))
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(graph):
        visit(node)


def test_file_and_function_sizes():
    long_files, long_functions = [], []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(SRC)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(
                        f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n})"
                    )
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


# Module-level circles allowed for now (each a frozenset of module names). Empty; circles
# through imports inside functions are refused too (tests/test_architecture_graph.py).
KNOWN_MODULE_CYCLES: set[frozenset[str]] = set()


def _module_level_imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The ``anyspeed`` modules ``path`` imports when it is imported: statements at module
    level (also under ``if``/``try`` there), not inside functions or ``if TYPE_CHECKING:``.
    ``from package import name`` counts as importing ``package.name`` when that is a module."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse,
                             node.finalbody):  # fmt: skip
                    visit(part)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("anyspeed"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if not base.startswith("anyspeed"):
                    continue
                subs = {f"{base}.{a.name}" for a in node.names} & modules
                found.update(subs or {base})
                if len(subs) < len(node.names):
                    found.add(base)

    visit(ast.parse(path.read_text()).body)
    found.discard(module)
    return found


def _package(module: str) -> str:
    return module.rsplit(".", 1)[0]


def test_no_cycle_between_modules_of_a_package():
    """Two modules of one package (at any depth below it) must not import each other at module
    level, directly or through others of that package: such a circle works only by the order
    of imports. Imports inside functions and under ``if TYPE_CHECKING:`` do not count."""
    modules = _modules()
    graph = {m: _module_level_imports(p, m, set(modules)) for m, p in modules.items()}
    found = []
    for top in {_unit(m) for m in modules}:
        inside = {m for m in modules if _unit(m) == top}
        sub = {m: sorted(t for t in graph[m] if t in inside) for m in inside}
        found += [c for c in cycles(sub) if frozenset(c) not in KNOWN_MODULE_CYCLES]
    assert not found, "modules of one package importing each other in a circle:\n" + "\n".join(
        ", ".join(c) for c in found
    )


# The parse itself, the functions that complete the parsed flags before they are frozen, and
# the freezer; every other write to a parsed namespace in the training and inference commands
# is a bug (keep derived state in the Run or the InferenceRun).
PARSE_TIME = {
    ("stages/arguments.py", "parse_pretrain_args"),
    ("stages/checks.py", "complete"),
    ("stages/checks.py", "_complete_architecture"),
    ("stages/checks.py", "_complete_vocab"),
    ("stages/common/raw_data.py", "resolve"),  # a raw --data-path -> its preprocessed prefix
    ("training/run.py", "freeze"),
    ("commands/session.py", "complete"),  # an inference command's defaults from its model
    ("commands/evaluate.py", "_complete"),  # the evaluated task's defaults
    ("commands/memory.py", "parse"),  # the padded vocabulary the estimate needs
    ("commands/training_flags.py", "parse"),  # an inference command line, parsed
}
TRAINING_PATH = ("training", "stages", "commands")


def _writes_to_args(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of each ``args.x = ...``, ``args.x += ...`` or
    ``setattr(args, ...)`` in ``tree``."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and (sub.value.id == "args")
                ):
                    found.append((func, node.lineno))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
                found.append((func, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def test_no_write_to_the_parsed_flags_after_parsing():
    bad = []
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        if not rel.startswith(TRAINING_PATH):
            continue
        for func, line in _writes_to_args(ast.parse(path.read_text())):
            if (rel, func) not in PARSE_TIME:
                bad.append(f"{rel}:{line} ({func})")
    assert not bad, "writes to the parsed namespace after parsing (use the Run):\n" + "\n".join(bad)


def test_the_write_check_sees_writes():
    """The check above is not vacuous: it finds each form of write."""
    code = "def f(args):\n    args.a = 1\n    args.b += 1\n    setattr(args, 'c', 2)\n"
    assert [line for _, line in _writes_to_args(ast.parse(code))] == [2, 3, 4]
