"""The HumanEval sandbox's IPC namespace and work directory (issue 43, item 6): a program's
System V shared-memory segment dies with it, and the program writes relative paths and
``tempfile`` files in its own work directory (EROFS before), which is removed afterwards."""

from __future__ import annotations

import os

import pytest

from anyspeed.inference.eval.execution import probe, run_program

SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
sid = libc.shmget(0, 256 << 20, 0o1600)  # IPC_PRIVATE | IPC_CREAT, 256 MiB
print("segment", sid, ctypes.get_errno())
"""

FILES = """
import os, tempfile
open("relative.txt", "w").write("x")
fd, path = tempfile.mkstemp()
os.write(fd, b"y")
os.close(fd)
os.remove(path)
print("wrote in", os.getcwd())
"""


def _segments() -> set[str]:
    with open("/proc/sysvipc/shm", encoding="utf-8") as f:
        return {line.split()[1] for line in f.readlines()[1:] if line.split()}


def test_a_shared_memory_segment_dies_with_the_program():
    if "ipc-namespace" in probe():
        pytest.skip(f"this machine refuses an IPC namespace: {probe()['ipc-namespace']}")
    before = _segments()
    out = run_program("shm", SHM, timeout=20.0)
    assert out.passed and int(out.output.split()[1]) >= 0, out.output  # it was created
    assert _segments() <= before, _segments() - before  # and is gone


def test_the_program_writes_in_its_own_directory():
    if "read-only-filesystem" in probe():
        pytest.skip("no read-only mount here: the work directory is not its own mount")
    out = run_program("files", FILES, timeout=20.0)
    assert out.passed, out.output
    work = out.output.split("wrote in ", 1)[1].split()[0]
    assert not os.path.exists(work)  # removed with everything the program wrote there
