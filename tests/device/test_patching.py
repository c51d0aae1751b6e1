"""PatchManager: replace, ordered wraps, undo, rebinding of from-imports, clear errors."""

from __future__ import annotations

import sys

import patch_target
import patch_user
import pytest

from anyspeed.patching import PatchError, PatchManager


@pytest.fixture
def pm():
    m = PatchManager(rebind_prefixes=("patch_",))
    yield m
    m.clear()


def test_replace_apply_undo(pm):
    original = patch_target.greet
    pm.register_replace("patch_target.greet", lambda n: f"hi {n}", feature="f", reason="r")
    pm.apply()
    assert patch_target.greet("a") == "hi a"
    pm.undo()
    assert patch_target.greet is original
    assert patch_target.greet("a") == "hello a"


def test_wraps_stack_in_order(pm):
    def tag(label):
        def wrapper(fn):
            return lambda n: f"{label}({fn(n)})"

        return wrapper

    pm.register_wrap("patch_target.greet", tag("outer"), feature="f", reason="r", order=10)
    pm.register_wrap("patch_target.greet", tag("inner"), feature="g", reason="r", order=0)
    pm.register_replace("patch_target.greet", lambda n: f"base {n}", feature="h", reason="r")
    pm.apply()
    # Replacement first, then wraps by ascending order: inner is closest to the replacement.
    assert patch_target.greet("x") == "outer(inner(base x))"


def test_rebinds_copies_taken_with_from_import(pm):
    assert patch_user.call() == "hello user"
    pm.register_replace("patch_target.greet", lambda n: f"patched {n}", feature="f", reason="r")
    pm.apply()
    assert patch_user.call() == "patched user"
    pm.undo()
    assert patch_user.call() == "hello user"


def test_second_replacement_refused(pm):
    pm.register_replace("patch_target.greet", lambda n: n, feature="first", reason="r")
    with pytest.raises(PatchError, match="already replaced by feature 'first'"):
        pm.register_replace("patch_target.greet", lambda n: n, feature="second", reason="r")


def test_missing_target_names_feature_and_version(pm):
    pm.register_replace("patch_target.no_such_function", lambda: 0, feature="myfeat", reason="r")
    with pytest.raises(PatchError) as err:
        pm.apply()
    msg = str(err.value)
    assert "myfeat" in msg and "patch_target.no_such_function" in msg
    assert "megatron-core 0.16.1" in msg


def test_missing_dependency_is_reported_as_such(pm, tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import surely_not_installed_pkg\nX = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm.register_replace("needs_dep.X", 2, feature="f", reason="r")
    with pytest.raises(PatchError, match="surely_not_installed_pkg"):
        pm.apply()


def test_method_patch_and_inherited_restore(pm):
    class Sub(patch_target.Box):
        pass

    pm.register_wrap(
        "patch_target.Box.size", lambda fn: lambda self: fn(self) + 41, feature="f", reason="r"
    )
    pm.apply()
    assert Sub().size() == 42
    pm.undo()
    assert Sub().size() == 1


def test_module_fallback_only_when_import_fails(pm, tmp_path, monkeypatch):
    (tmp_path / "broken_mod.py").write_text("import surely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import types

    pm.register_module_fallback(
        "broken_mod", lambda exc: types.SimpleNamespace(ok=True), feature="f", reason="r"
    )
    pm.apply()
    assert sys.modules["broken_mod"].ok
    pm.undo()
    assert "broken_mod" not in sys.modules


def test_report_lists_feature_and_reason(pm):
    pm.register_replace("patch_target.greet", lambda n: n, feature="feat-a", reason="because")
    (p,) = pm.patches("feat-a")
    assert (p.target, p.kind, p.feature, p.reason) == (
        "patch_target.greet",
        "replace",
        "feat-a",
        "because",
    )


def test_undo_restores_copies_taken_after_apply(pm):
    """A module imported after apply() copies the patched object; undo() restores it too."""
    import importlib

    pm.register_replace("patch_target.greet", lambda n: f"hi {n}", feature="f", reason="r")
    pm.apply()
    sys.modules.pop("patch_late_user", None)
    late = importlib.import_module("patch_late_user")
    assert late.call() == "hi late"
    pm.undo()
    assert late.call() == "hello late"
