"""Every module of ``src/anyspeed`` imports: no module names something that is not there.

The static check in ``scripts/test.sh`` (mypy, configured in pyproject.toml) reads the imports
inside functions too; this test runs the module-level ones for real. ``anyspeed.megatron_adaptor``
(applies patches on import) and ``anyspeed.__main__`` (runs the command line) are left out.
"""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

SKIP = {"anyspeed.megatron_adaptor", "anyspeed.__main__"}


def test_every_module_imports():
    """In this process (torch and Megatron are imported already, so it takes seconds): a
    module's import runs no command and applies no patch, which the layer rules keep so."""
    import importlib
    import pkgutil
    import warnings

    import anyspeed

    names = sorted(m.name for m in pkgutil.walk_packages(anyspeed.__path__, "anyspeed."))
    assert len(names) > 100  # the walk found the package's modules
    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name in SKIP:
                continue
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - every module's failure, listed
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)
