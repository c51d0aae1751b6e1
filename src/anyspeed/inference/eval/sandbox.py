"""The launcher that runs one HumanEval program in a sandbox (run as a script; stdlib only).

``python -I -S -B sandbox.py CONFIG_JSON STATUS_FD`` runs ``CONFIG["program"]`` and writes one
JSON line to STATUS_FD: the program's exit status, whether it timed out, or why the sandbox
could not be set up. Why a separate process: the namespaces must be entered before the fork
that makes the program, and the launcher must outlive the program to end whatever it left.

The protections, each used when CONFIG["use"] names it (``probe`` finds which the kernel
allows, trying each one and reporting the reason it fails):

* ``pid-namespace``: the program is PID 1 of a new PID namespace with its own ``/proc``; when
  it ends the kernel kills every process it started (a ``setsid`` child included), and it can
  see no process outside.
* ``network-namespace``: a new network namespace with no interface up: no connection anywhere.
* ``read-only-filesystem``: a new mount namespace where every mount is read-only except the
  program's work directory.
* ``separate-user`` (the launcher runs as root): the program runs as a uid of its own
  (``UID_BASE`` + the launcher's pid), so ``RLIMIT_NPROC`` 1 forbids any new process (root is
  exempt from it), and the program cannot signal the evaluator, read its ``/proc/PID/environ``
  or write any file it does not own.

Always: resource limits (address space, CPU time, file size, open files, processes, no core
file), its own session, an empty environment, and -- whatever the namespaces -- the launcher is a
child subreaper and kills every descendant left when the program ends.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE = {
    "read-only-filesystem": 0x00020000,
    "pid-namespace": 0x20000000,
    "network-namespace": 0x40000000,
    "ipc-namespace": 0x08000000,  # System V IPC and POSIX queues die with the program
}
CLONE_NEWUSER = 0x10000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x4000, 1 << 18, 2, 4, 8
AT_RECURSIVE, MOUNT_ATTR_RDONLY, SYS_MOUNT_SETATTR = 0x8000, 1, 442
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 1, 36, 38, 24
UID_BASE = 1_000_000_000  # far above any real user; unique per launcher pid
PROTECTIONS = (
    "pid-namespace",
    "network-namespace",
    "ipc-namespace",
    "read-only-filesystem",
    "separate-user",
)
# Runs in the program's interpreter before the program: a clearer message for the common
# escapes (the kernel-level protections above are what hold; this layer is easy to bypass).
RUNNER = """\
import builtins, os, runpy, shutil, socket, subprocess, sys
def _blocked(*a, **k):
    raise PermissionError("blocked by anyspeed evaluate's sandbox")
_work = os.path.realpath(os.getcwd()) + os.sep  # the program's own writable directory
def _in_work(f):
    def guarded(*a, **k):  # file changes inside the work dir only (tempfile needs unlink)
        paths = [os.fsdecode(x) for x in a[:2] if isinstance(x, (str, bytes, os.PathLike))]
        if paths and all(os.path.realpath(x).startswith(_work) for x in paths):
            return f(*a, **k)
        raise PermissionError("blocked by anyspeed evaluate's sandbox (outside its directory)")
    return guarded
for _n in ("remove", "unlink", "rmdir", "rename", "replace", "truncate", "chmod"):
    setattr(os, _n, _in_work(getattr(os, _n)))
for _m, _names in ((socket, ("socket", "create_connection", "getaddrinfo", "socketpair")),
                   (os, ("system", "fork", "forkpty", "kill", "killpg", "execv", "execve",
                         "execvp", "spawnv", "popen", "removedirs", "renames", "chown",
                         "putenv")),
                   (shutil, ("rmtree", "move", "chown")),
                   (subprocess, ("Popen", "run", "call", "check_call", "check_output"))):
    for _n in _names:
        setattr(_m, _n, _blocked)
builtins.exit = builtins.quit = _blocked
_path = sys.argv.pop(1)
del _m, _names, _n, _blocked, _in_work
runpy.run_path(_path, run_name="__main__")
"""

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _call(name: str, result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)} ({_errno_name(err)})")


def _errno_name(err: int) -> str:
    import errno

    return errno.errorcode.get(err, str(err))


def _mount(src: str | None, target: str, fstype: str | None, flags: int) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype)]
    _call(f"mount {target}", _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), None))


def _mount_setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    _call(
        f"mount_setattr {path}",
        _libc.syscall(
            SYS_MOUNT_SETATTR, -100, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
        ),
    )


def enter_namespaces(use: list[str], strict: bool, which: tuple[str, ...]) -> dict[str, str]:
    """Unshare each namespace of ``which`` that ``use`` names (a user namespace first when not
    root and ``which`` is the launcher's); the ones that failed, with the reason (raises
    instead when ``strict``). The launcher enters the PID namespace (its next child is PID 1
    there), the program's process the mount and network ones (the launcher keeps the host's
    ``/proc`` to find the program's descendants)."""
    missing: dict[str, str] = {}
    wanted = [p for p in use if p in which]
    if os.getuid() != 0 and "pid-namespace" in which and any(p in CLONE for p in use):
        try:
            uid, gid = os.getuid(), os.getgid()
            _call("unshare(CLONE_NEWUSER)", _libc.unshare(CLONE_NEWUSER))
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"0 {uid} 1"),
                ("gid_map", f"0 {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as exc:
            if strict:
                raise
            return {p: f"no user namespace ({exc.strerror or exc})" for p in use if p in CLONE}
    for p in wanted:
        try:
            _call(f"unshare({p})", _libc.unshare(CLONE[p]))
        except OSError as exc:
            if strict:
                raise
            missing[p] = str(exc.strerror or exc)
    return missing


def setup_child(cfg: dict, use: list[str], strict: bool) -> dict[str, str]:
    """In the program's process before exec: mounts, limits, session, user. The protections
    that failed, with the reason (raises instead when ``strict``)."""
    missing = enter_namespaces(
        use, strict, ("network-namespace", "ipc-namespace", "read-only-filesystem")
    )
    use = [p for p in use if p not in missing]
    work = cfg["workdir"]
    if "read-only-filesystem" in use:
        try:
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            _mount(work, work, None, 0x1000)  # MS_BIND: the work dir, its own mount
            _mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
            _mount_setattr(work, 0, 0, MOUNT_ATTR_RDONLY)
            os.chdir(work)  # the writable mount, not the directory under it (EROFS)
            if "pid-namespace" in use:  # a /proc that shows this namespace only
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as exc:
            if strict:
                raise
            missing["read-only-filesystem"] = str(exc.strerror or exc)
    lim = cfg["limits"]
    for name, value in (
        ("RLIMIT_AS", lim["memory_bytes"]),
        ("RLIMIT_CPU", lim["cpu_seconds"]),
        ("RLIMIT_FSIZE", lim["file_bytes"]),
        ("RLIMIT_NOFILE", lim["open_files"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))
    os.setsid()  # kill(0, ...) reaches the program's own group only
    cfg["exec"] = cfg["python"]
    if "separate-user" in use:  # root here: the launcher dropped it otherwise
        why = _expose_python(cfg, use)
        if why:
            if strict:
                raise OSError(f"separate-user: {why}")
            missing["separate-user"] = why
        else:
            try:  # root inside a user namespace may have no other uid mapped (EINVAL)
                os.setgroups([])
                os.setgid(cfg["uid"])
                os.setuid(cfg["uid"])
                resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
            except OSError as exc:
                if strict or os.getuid() != 0:  # half changed: never run the program
                    raise
                missing["separate-user"] = f"setuid({cfg['uid']}): {exc.strerror}"
    _drop_capabilities()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid: it clears it
    return missing


def _drop_capabilities() -> None:
    """No capability left, none to regain (no-new-privs, an empty bounding set): a program
    that still runs as root (no separate-user) cannot remount, unshare its way out or load
    anything into the kernel. After a setuid away from root they are already gone."""
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last one: ignored
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
    _call("capset", _libc.capset(header, data))


def _expose_python(cfg: dict, use: list[str]) -> str | None:
    """Make the interpreter runnable by the sandbox user: where a directory on its path is
    private (``/root`` is 0700), its installation is bind-mounted read-only into the work
    directory and run from there (stdlib only: the program needs no site-packages). Why it
    cannot be, or None."""
    real, prefix = os.path.realpath(cfg["python"]), cfg["base_prefix"]
    private = next((d for d in _parents(real) if not os.stat(d).st_mode & 0o001), None)
    if private is None:
        return None
    if "read-only-filesystem" not in use or not real.startswith(prefix + os.sep):
        return (
            f"{private} is private to its owner, so another user cannot run {real} "
            "(mounting it elsewhere needs read-only-filesystem)"
        )
    inner = os.path.join(cfg["workdir"], ".python")
    os.mkdir(inner, 0o755)
    _mount(prefix, inner, None, 0x1000 | MS_REC)  # MS_BIND; read-only like its source
    cfg["exec"] = os.path.join(inner, os.path.relpath(real, prefix))
    # A shared-library build (pyenv's) finds libpython by its absolute RUNPATH, under the
    # private directory: the loader looks in the mounted copy first.
    os.environ["LD_LIBRARY_PATH"] = os.path.join(inner, "lib")
    return None


def _parents(path: str) -> list[str]:
    """The directories from ``/`` down to the one holding ``path``."""
    parts = path.split(os.sep)[1:-1]
    return [os.sep + os.sep.join(parts[:i]) for i in range(len(parts) + 1)]


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (by walking ``/proc``)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(entry)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def end_tree() -> None:
    """SIGKILL and reap every descendant of this (subreaper) launcher, until none is left."""
    for _ in range(200):
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG) != (0, 0):
                pass
        except ChildProcessError:
            return
        time.sleep(0.005)  # killed ones still exiting


def _timeout(signum: int, frame: object) -> None:
    raise TimeoutError


def launch(cfg: dict, status_fd: int) -> dict:
    """Fork the program inside the sandbox, wait for it (``cfg["timeout"]``), end its tree."""
    use, strict = list(cfg["use"]), not cfg.get("probe")
    cfg["uid"] = UID_BASE + os.getpid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the evaluator is already gone
        return {"error": "the evaluator exited"}
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.set_inheritable(status_fd, False)
    if "separate-user" in use and os.getuid() != 0:  # checked before a user namespace
        if strict:
            return {"error": "sandbox setup: separate-user needs an evaluator running as root"}
        use.remove("separate-user")
        cfg["missing"] = {"separate-user": "the evaluator does not run as root"}
    try:
        missing = dict(cfg.get("missing", {}), **enter_namespaces(use, strict, ("pid-namespace",)))
        if "separate-user" in use:
            try:  # the work dir becomes the program's
                os.chown(cfg["workdir"], cfg["uid"], cfg["uid"])
            except OSError as exc:  # root in a user namespace: no other uid is mapped
                if strict:
                    raise
                missing["separate-user"] = f"chown to uid {cfg['uid']}: {exc.strerror}"
    except OSError as exc:
        return {"error": f"sandbox setup: {exc.strerror or exc}"}
    use = [p for p in use if p not in missing]
    report_r, report_w = os.pipe()  # close-on-exec: EOF once the program runs
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        try:
            child_missing = setup_child(cfg, use, strict)
            os.write(report_w, json.dumps({"missing": child_missing}).encode() + b"\n")
            os.execv(cfg["exec"], [cfg["exec"], "-I", "-B", "-c", RUNNER, cfg["program"]])
        except BaseException as exc:  # noqa: BLE001 - any failure is the sandbox's
            os.write(report_w, json.dumps({"error": f"sandbox setup: {exc}"}).encode() + b"\n")
        os._exit(125)
    os.close(report_w)
    with os.fdopen(report_r, "rb") as f:
        lines = [json.loads(line) for line in f.read().splitlines()]
    result: dict = {"missing": missing}
    for line in lines:
        result["missing"].update(line.get("missing", {}))
        if line.get("error"):
            result.setdefault("error", line["error"])
    signal.signal(signal.SIGALRM, _timeout)
    signal.setitimer(signal.ITIMER_REAL, cfg["timeout"])
    try:
        _, status = os.waitpid(pid, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        result["status"] = os.waitstatus_to_exitcode(status)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        result["timed_out"] = True
    end_tree()
    return result


def main(argv: list[str]) -> int:
    """The launcher's entry point: ``CONFIG_JSON STATUS_FD``."""
    cfg, status_fd = json.loads(argv[1]), int(argv[2])
    try:
        result = launch(cfg, status_fd)
    except Exception as exc:  # noqa: BLE001 - reported, never a traceback in the evaluator
        result = {"error": f"sandbox launcher: {exc!r}"}
    os.write(status_fd, json.dumps(result).encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
