"""The HumanEval sandbox against ten escape attempts, each written with the low-level modules
(``posix``, ``_socket``) that step around the Python-level guard, so the kernel-level
protections are what is tested. One evaluator process (started with a secret in its
environment) runs every program in turn; each test checks one attempt's effect from outside.
Protections the machine refuses (``probe()``) skip the checks that rest on them."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from anyspeed.inference.eval.execution import CAPTURE_BYTES, probe

ROOT = Path(__file__).resolve().parents[2]
SECRET = "anyspeed-secret-4f1c9e"
TOKEN = f"97.{random.randrange(10**6):06d}"  # a `sleep` argument no other process has
# The evaluator: runs each case through run_program, notes its own peak-RSS growth per case
DRIVER = """\
import json, os, resource, sys
from anyspeed.inference.eval import execution as E
cases, out = json.loads(sys.argv[1]), {"pid": os.getpid(), "missing": E.probe()}
for c in cases:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    o = E.run_program(c["name"], c["source"].replace("EVAL_PID", str(os.getpid())),
                      timeout=c.get("timeout", 20.0), use=c.get("use"),
                      processes=c.get("processes", 1))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    out[c["name"]] = {"passed": o.passed, "reason": o.reason, "output": o.output,
                      "rss_growth_kib": grown}
print(json.dumps(out))
"""
SETSID = f"""\
import posix, time
r, w = posix.pipe()
pid = posix.fork()
if pid == 0:
    posix.setsid()
    posix.write(w, b"x")
    posix.execv("/bin/sleep", ["sleep", "{TOKEN}"])
posix.read(r, 1)
time.sleep(0.3)
print("child", pid)
"""


def _cases(victims: dict[str, str], port: int) -> list[dict]:
    v = victims
    return [
        {"name": "stderr", "timeout": 60.0, "source": "import sys\nb = b'x' * (1 << 20)\n"
         "for _ in range(400):\n    sys.stderr.buffer.write(b)\n"},
        {"name": "write", "source": f"open({v['write']!r}, 'a').write('pwned')\n"},
        {"name": "truncate", "source": f"import posix\nposix.truncate({v['truncate']!r}, 0)\n"},
        {"name": "move", "source": f"import posix\nposix.rename({v['move']!r}, "
         f"{v['move'] + '.moved'!r})\n"},
        {"name": "delete", "source": f"import posix\nposix.unlink({v['delete']!r})\n"},
        {"name": "spawn", "source": "import posix\nif posix.fork() == 0:\n    posix._exit(0)\n"
         "print('spawned')\n"},
        {"name": "socket", "source": "import _socket\ns = _socket.socket()\ns.settimeout(3)\n"
         f"s.connect(('127.0.0.1', {port}))\ns.sendall(b'leak')\n"},
        {"name": "signal", "source": "import posix, signal\nfor pid in (EVAL_PID, "
         "posix.getppid()):\n    try:\n        posix.kill(pid, signal.SIGTERM)\n"
         "    except OSError as e:\n        print(pid, e)\n"},
        {"name": "environ", "source": "import os, posix\nprint(dict(os.environ))\n"
         "for pid in (EVAL_PID, posix.getppid()):\n    try:\n"
         "        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
         "    except OSError as e:\n        print(pid, e)\n"},
        {"name": "setsid", "source": SETSID, "processes": 8},
        {"name": "setsid-no-namespaces", "source": SETSID, "processes": 8, "use": []},
        {"name": "future", "source": "from __future__ import annotations\nimport os\n"
         "def f(x: Undefined) -> int:\n    return 1\nassert f(0) == 1\nprint(os.getcwd())\n"},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def victims():
    """Files anyone may write (0666 in a 0777 directory): only the sandbox protects them."""
    d = tempfile.mkdtemp(prefix="anyspeed-victims-")
    os.chmod(d, 0o777)
    paths = {}
    for name in ("write", "truncate", "move", "delete"):
        paths[name] = os.path.join(d, name)
        Path(paths[name]).write_text("original")
        os.chmod(paths[name], 0o666)
    yield paths
    shutil.rmtree(d)


@pytest.fixture(scope="module")
def listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        s.setblocking(False)
        yield s


@pytest.fixture(scope="module")
def run(victims: dict[str, str], listener: socket.socket) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), ANYSPEED_TEST_SECRET=SECRET)
    cases = _cases(victims, listener.getsockname()[1])
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]  # the evaluator survived every program
    return json.loads(proc.stdout)


def _needs(run: dict, *protections: str) -> None:
    missing = [p for p in protections if p in run["missing"]]
    if missing:
        pytest.skip(f"this machine refuses {', '.join(missing)}: {run['missing']}")


def test_files_outside_the_work_dir_are_untouched(run: dict, victims: dict[str, str]) -> None:
    _needs(run, "read-only-filesystem")
    for name in ("write", "truncate", "move", "delete"):
        assert not run[name]["passed"], run[name]
        assert Path(victims[name]).read_text() == "original", name
    assert not os.path.exists(victims["move"] + ".moved")


def test_no_new_process(run: dict) -> None:
    _needs(run, "separate-user")
    assert not run["spawn"]["passed"] and "spawned" not in run["spawn"]["output"]
    assert "Resource temporarily unavailable" in run["spawn"]["reason"]


def test_no_network(run: dict, listener: socket.socket) -> None:
    _needs(run, "network-namespace")
    assert not run["socket"]["passed"]
    with pytest.raises(BlockingIOError):  # nothing ever connected
        listener.accept()


def test_the_evaluator_survives_signals(run: dict) -> None:
    assert run["pid"] > 0  # the driver printed its report after every program ran


def test_no_secret_from_the_evaluators_environment(run: dict) -> None:
    out = run["environ"]
    assert out["passed"] and "HOME" in out["output"], out  # it ran and printed its environ
    assert SECRET not in out["output"]


def test_no_process_outlives_the_run(run: dict) -> None:
    for name in ("setsid", "setsid-no-namespaces"):
        assert run[name]["passed"] and "child" in run[name]["output"], run[name]
    left = []
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if TOKEN.encode() in cmd and b"sleep" in cmd:
            left.append(entry)
    assert not left, f"setsid children still running: {left}"


def test_gigabytes_on_stderr_cost_the_evaluator_no_memory(run: dict) -> None:
    out = run["stderr"]
    assert out["passed"], out
    assert out["rss_growth_kib"] < 50 * 1024, out  # 400 MB written, under 50 MB grown
    assert CAPTURE_BYTES <= 64 << 10


def test_future_imports_run_in_a_removed_work_dir(run: dict) -> None:
    out = run["future"]
    assert out["passed"], out
    work = out["output"].strip()
    assert work.startswith(tempfile.gettempdir()) and not os.path.exists(work)


def test_probe_names_each_missing_protection_with_a_reason() -> None:
    from anyspeed.inference.eval.execution import missing_protections

    lines = missing_protections()
    assert len(lines) == len(probe())
    assert all("\n" not in line and line.startswith("HumanEval sandbox: no ") for line in lines)


def test_every_protection_has_a_warning_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that refuses them all (the launcher's test program failed) gets a line for
    each; ipc-namespace had none, and the warning itself raised KeyError."""
    from anyspeed.inference.eval import execution, sandbox

    monkeypatch.setattr(execution, "probe", lambda: dict.fromkeys(sandbox.PROTECTIONS, "why"))
    lines = execution.missing_protections()
    assert [line.split(" (")[0][len("HumanEval sandbox: no ") :] for line in lines] == list(
        sandbox.PROTECTIONS
    )


def test_a_refused_protection_is_named_and_the_rest_still_hold(tmp_path: Path) -> None:
    """As root of a user namespace (a rootless container) no other uid exists: separate-user
    is reported missing with the kernel's reason, while the mount namespace still keeps files
    outside the work dir and the dropped capabilities keep it from being remounted."""
    if not shutil.which("unshare") or subprocess.run(
        ["unshare", "--user", "--map-root-user", "true"], capture_output=True
    ).returncode:  # fmt: skip
        pytest.skip("no unprivileged user namespaces here")
    victim = tmp_path / "victim"
    victim.write_text("original")
    os.chmod(tmp_path, 0o777)
    os.chmod(victim, 0o666)
    code = (
        "import json\nfrom anyspeed.inference.eval import execution as E\n"
        f"o = E.run_program('t', {f'open({str(victim)!r}, chr(119)).write(chr(120))'!r})\n"
        "print(json.dumps({'lines': E.missing_protections(), 'reason': o.reason}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert any(line.startswith("HumanEval sandbox: no separate-user (") for line in out["lines"])
    assert "Read-only file system" in out["reason"] and victim.read_text() == "original"


def test_the_program_runs_on_its_own_interpreters_library() -> None:
    """A shared-library interpreter under a private directory (pyenv's under /root) is run
    from a mounted copy; its libpython must come from that copy too. Its RUNPATH names the
    private path, so Python 3.12 failed to start there and 3.11 loaded the system's copy."""
    import sysconfig

    from anyspeed.inference.eval.execution import run_program

    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        pytest.skip("a statically linked interpreter: no libpython to find")
    code = "print([l.split()[-1] for l in open('/proc/self/maps') if 'libpython' in l][0])"
    o = run_program("lib", code)
    assert o.passed, o.reason
    lib = o.output.strip()
    assert "/.python/lib/" in lib or lib.startswith(os.path.realpath(sys.base_prefix)), lib
