"""The import graph, counting imports inside functions: no circle anywhere, no stage importing
a sibling stage, no private name imported from another module. (``test_architecture.py``
checks layers and sizes; these rules see the imports it does not count.)"""

from __future__ import annotations

from helpers.code_graph import SRC, cycles, import_statements, modules, runtime_graph

# The stage families under anyspeed.stages; the rest of stages/ (table, flags, prepare, checks,
# arguments, ranges, common) is shared by all of them.
STAGE_FAMILIES = ("pretrain", "sft", "preference", "grpo", "ppo", "vlm")


def test_no_import_circle_anywhere():
    found = cycles(runtime_graph())
    assert not found, "modules importing each other in a circle (imports in functions count):\n" + (
        "\n".join(", ".join(c) for c in found)
    )


def _family(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "stages" and parts[2] in STAGE_FAMILIES:
        return parts[2]
    return None


def test_no_stage_imports_a_sibling_and_shared_code_imports_no_stage():
    bad = []
    for module, path in modules().items():
        mine = _family(module)
        if not module.startswith("anyspeed.stages") or module == "anyspeed.stages.table":
            continue  # the table names every stage
        for base, names, line in import_statements(path, module):
            targets = [base] + [f"{base}.{n}" for n in names]
            theirs = {_family(t) for t in targets} - {None}
            if theirs - {mine}:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {base} ({sorted(theirs)})")
    assert not bad, "a stage imports another stage (share it through stages.common):\n" + "\n".join(
        bad
    )


def _private_imports(path, module: str) -> list[str]:
    where = path.relative_to(SRC) if path.is_relative_to(SRC) else path
    return [
        f"{where}:{line} takes {name} from {base}"
        for base, names, line in import_statements(path, module)
        for name in names
        if name.startswith("_") and not name.startswith("__") and base != module
    ]


def test_no_private_name_is_imported_from_another_module():
    bad = [hit for module, path in modules().items() for hit in _private_imports(path, module)]
    assert not bad, "private names imported across modules (make them public):\n" + "\n".join(bad)


def test_the_graph_rules_see_what_they_check(tmp_path):
    """Not vacuous: a circle through a function-level import, and a private import, are found;
    an import under TYPE_CHECKING is not counted."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    code = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from anyspeed.x import T\n"
        "def f():\n    from anyspeed.y import _secret, ok\n"
    )
    probe = tmp_path / "probe.py"
    probe.write_text(code)
    assert import_statements(probe, "anyspeed.probe") == [("anyspeed.y", ["_secret", "ok"], 5)]
    assert len(_private_imports(probe, "anyspeed.probe")) == 1
