"""PatchManager: accountable monkey-patches addressed by dotted target path.

A patch either *replaces* a target or *wraps* it (``wrapper(previous) -> new``). Wraps stack in
ascending ``order`` (then registration order) on top of the replacement or the original. Every
patch records the feature that owns it and why it exists, so ``anyspeed features`` can show what
is applied. Applying also rebinds copies taken earlier with ``from module import name`` in modules
under the configured prefixes; ``undo`` restores everything.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

__all__ = ["Patch", "PatchError", "PatchManager", "resolve_target"]

_MISSING = object()


class PatchError(RuntimeError):
    """A patch cannot be registered or applied (missing target, conflicting replacement)."""


@dataclass
class Patch:
    """One registered change to one target."""

    target: str
    kind: str  # "replace" | "wrap" | "module"
    obj: Any  # the replacement, or the wrapper factory ``wrapper(previous) -> new``
    feature: str
    reason: str
    order: int = 0
    seq: int = 0
    create: bool = False  # a replacement may add an attribute that does not exist yet


def _installed_versions() -> str:
    parts = []
    for dist in ("megatron-core", "torch"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} (not installed)")
    return ", ".join(parts)


def resolve_target(target: str) -> tuple[Any, str]:
    """Return ``(owner, attribute)`` for a dotted path such as ``torch.cuda.current_device``.

    The longest importable module prefix is imported; the remaining components are attributes
    (so ``pkg.mod.Class.method`` works). Raises AttributeError/ImportError when absent.
    """
    parts = target.split(".")
    if len(parts) < 2:
        raise ValueError(f"patch target {target!r} must be a dotted path 'module.attr'")
    owner: Any = None
    split = 0
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            owner = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not name.startswith(exc.name):
                raise  # the module exists but one of *its* imports is missing
            continue
        split = i
        break
    if owner is None:
        raise ImportError(f"no importable module in {target!r}")
    for attr in parts[split:-1]:
        owner = getattr(owner, attr)
    return owner, parts[-1]


@dataclass
class _Applied:
    owner: Any
    attr: str
    original: Any
    rebinds: list[tuple[dict, str, Any]] = field(default_factory=list)
    standin: bool = False  # a module fallback installed a stand-in module
    installed: Any = _MISSING  # what apply() put there, and what it replaced
    previous: Any = _MISSING


class PatchManager:
    """Registry of patches; apply() installs them, undo() restores the originals."""

    def __init__(self, rebind_prefixes: Iterable[str] = ("megatron", "anyspeed")) -> None:
        self.rebind_prefixes = tuple(rebind_prefixes)
        self._patches: dict[str, list[Patch]] = {}
        self._applied: dict[str, _Applied] = {}
        self._seq = 0

    # ---------------------------------------------------------------- registration
    def register_replace(
        self, target: str, new: Any, *, feature: str, reason: str, create: bool = False
    ) -> None:
        """Replace ``target`` by ``new``. A second replacement of one target is refused."""
        for p in self._patches.get(target, []):
            if p.kind == "replace":
                raise PatchError(
                    f"{target} is already replaced by feature '{p.feature}'; feature '{feature}' "
                    "cannot replace it too (wrap it instead)"
                )
        self._add(Patch(target, "replace", new, feature, reason, create=create))

    def register_wrap(
        self,
        target: str,
        wrapper: Callable[[Any], Any],
        *,
        feature: str,
        reason: str,
        order: int = 0,
    ) -> None:
        """Wrap ``target``: ``wrapper(previous)`` returns the new object. Lower order is inner."""
        self._add(Patch(target, "wrap", wrapper, feature, reason, order=order))

    def register_module_fallback(
        self, name: str, factory: Callable[[BaseException], Any], *, feature: str, reason: str
    ) -> None:
        """If importing module ``name`` fails, install ``factory(error)`` as that module.

        For Megatron modules that import optional CUDA-only packages (triton, ...) at the top:
        the stand-in keeps the names importable and raises a clear error when actually used.
        """
        self._add(Patch(name, "module", factory, feature, reason))

    def _add(self, patch: Patch) -> None:
        if patch.target in self._applied:
            raise PatchError(f"cannot register on {patch.target}: patches are applied; undo first")
        self._seq += 1
        patch.seq = self._seq
        self._patches.setdefault(patch.target, []).append(patch)

    # ---------------------------------------------------------------- introspection
    def patches(self, feature: str | None = None) -> list[Patch]:
        """Registered patches, optionally only those of one feature, in registration order."""
        out = [p for ps in self._patches.values() for p in ps]
        if feature is not None:
            out = [p for p in out if p.feature == feature]
        return sorted(out, key=lambda p: p.seq)

    def is_applied(self, target: str) -> bool:
        return target in self._applied

    # ---------------------------------------------------------------- apply / undo
    def apply(self) -> None:
        """Install every registered, not yet applied patch; rebind earlier ``from`` imports."""
        replaced: dict[int, tuple[Any, Any]] = {}
        # Module stand-ins first: resolving other targets may import the modules they replace.
        for target, plist in self._patches.items():
            if plist[0].kind == "module" and target not in self._applied:
                self._apply_module(plist[0])
        for target, plist in self._patches.items():
            if target in self._applied:
                continue
            try:
                owner, attr = resolve_target(target)
            except ModuleNotFoundError as exc:
                feats = ", ".join(sorted({p.feature for p in plist}))
                raise PatchError(
                    f"feature '{feats}': cannot import the module of patch target {target}: "
                    f"{exc} (install the missing package)"
                ) from None
            except (ImportError, AttributeError) as exc:
                feats = ", ".join(sorted({p.feature for p in plist}))
                raise PatchError(
                    f"feature '{feats}': patch target {target} does not exist in the installed "
                    f"{_installed_versions()} ({exc})"
                ) from None
            original = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else None
            current = getattr(owner, attr, _MISSING)
            rep = [p for p in plist if p.kind == "replace"]
            if current is _MISSING and not (rep and rep[0].create):
                feats = ", ".join(sorted({p.feature for p in plist}))
                raise PatchError(
                    f"feature '{feats}': patch target {target} does not exist in the installed "
                    f"{_installed_versions()}"
                )
            obj = rep[0].obj if rep else current
            for p in sorted((p for p in plist if p.kind == "wrap"), key=lambda p: (p.order, p.seq)):
                obj = p.obj(obj)
            setattr(owner, attr, obj)
            self._applied[target] = _Applied(owner, attr, original, installed=obj, previous=current)
            if current is not _MISSING and _is_rebindable(current):
                replaced[id(current)] = (current, obj, target)
        if replaced:
            self._rebind(replaced)

    def _apply_module(self, patch: Patch) -> None:
        record = _Applied(sys.modules, patch.target, _MISSING)
        self._applied[patch.target] = record
        try:
            importlib.import_module(patch.target)
            return  # the real module imports: nothing to stand in for
        except ImportError as exc:
            module = patch.obj(exc)
        sys.modules[patch.target] = module
        parent, _, child = patch.target.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
        record.standin = True

    def _rebind(self, replaced: dict[int, tuple[Any, Any, str]]) -> None:
        for modname, module in list(sys.modules.items()):
            if module is None or not modname.startswith(self.rebind_prefixes):
                continue
            g = getattr(module, "__dict__", None)
            if g is None:
                continue
            for name, value in list(g.items()):
                hit = replaced.get(id(value))
                if hit is not None and hit[0] is value:
                    g[name] = hit[1]
                    self._applied[hit[2]].rebinds.append((g, name, value))

    def undo(self) -> None:
        """Restore every applied target and every rebound copy, including the copies that
        modules imported after apply() took of the patched object."""
        for target in reversed(list(self._applied)):
            rec = self._applied.pop(target)
            if rec.owner is sys.modules:
                if rec.standin:
                    sys.modules.pop(rec.attr, None)
                continue
            for g, name, value in rec.rebinds:
                g[name] = value
            if rec.previous is not _MISSING and _is_rebindable(rec.installed):
                self._unbind_later_copies(rec.installed, rec.previous)
            if rec.original is _MISSING:
                try:
                    delattr(rec.owner, rec.attr)
                except AttributeError:
                    pass
            else:
                setattr(rec.owner, rec.attr, rec.original)

    def _unbind_later_copies(self, installed: Any, previous: Any) -> None:
        # Only in the patched libraries: anyspeed's own modules define the replacements.
        for modname, module in list(sys.modules.items()):
            if module is None or not modname.startswith(self.rebind_prefixes):
                continue
            if modname == "anyspeed" or modname.startswith("anyspeed."):
                continue
            g = getattr(module, "__dict__", None)
            for name, value in list((g or {}).items()):
                if value is installed:
                    g[name] = previous

    def clear(self) -> None:
        """Undo and forget all registrations."""
        self.undo()
        self._patches.clear()


def _is_rebindable(obj: Any) -> bool:
    # Rebinding by identity only makes sense for functions, classes and similar singletons;
    # small ints, strings and None would match unrelated globals.
    return not isinstance(obj, (int, float, str, bytes, bool, type(None), tuple))
