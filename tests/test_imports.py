"""Every module of ``src/anyspeed`` imports: no module names something that is not there.

The static check in ``scripts/test.sh`` (mypy, configured in pyproject.toml) reads the imports
inside functions too; this test runs the module-level ones for real, in a fresh interpreter so
that nothing a module does on import reaches the other tests. ``anyspeed.megatron_adaptor``
(applies patches on import) and ``anyspeed.__main__`` (runs the command line) are left out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

_SCRIPT = """
import importlib, pkgutil, sys, warnings
warnings.simplefilter("ignore")
import anyspeed
skip = {"anyspeed.megatron_adaptor", "anyspeed.__main__"}
names = sorted(m.name for m in pkgutil.walk_packages(anyspeed.__path__, "anyspeed."))
failed = []
for name in names:
    if name in skip:
        continue
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print(len(names))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         cwd=SRC, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert int(out.stdout.split()[0]) > 100, out.stdout  # the walk found the package's modules
