"""The test harness: where a rank that crashed (SIGSEGV) died (a peer's 'connection closed'
error alone does not say, which left a crash in CI without a stack), and ranks forked from a
preloaded server that start as spawned ones."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping

import pytest

from anyspeed.testing import DistributedError, forkserver, run_distributed
from helpers import harness_ranks


@pytest.mark.parametrize("fresh", [True, False])
def test_a_segfaulting_rank_reports_its_stack(fresh: bool) -> None:
    with pytest.raises(DistributedError) as err:
        run_distributed(harness_ranks.crash_in_named_frame, 2, victim=1, timeout=60, fresh=fresh)
    text = str(err.value)
    assert "rank 1 died of signal 11" in text
    assert "crash_in_named_frame" in text  # the dumped Python stack names the frame


# The variables a rank sets for itself, and pytest's per-test one.
_OWN = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTEST_CURRENT_TEST",
}


def _strip(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _OWN}


@pytest.fixture
def server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's environment put back as the fork server started with it, for the test:
    earlier in-process tests (an in-process ``anyspeed`` command's quiet mode, a launcher's
    ``OMP_NUM_THREADS``) may have set variables since, which send calls to spawned ranks, as
    designed, and these tests are about the forked ones."""
    forkserver.context({})  # (starts the server with the environment now, if not yet started)
    env = forkserver._server_env
    if env is None:  # no fork server here (CUDA, an accelerator, not Linux): nothing to match
        return
    for key in set(os.environ) - set(env) - forkserver._RUN_TIME:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key not in forkserver._RUN_TIME and os.environ.get(key) != value:
            monkeypatch.setenv(key, value)


@pytest.mark.usefixtures("server_env")
def test_a_forked_rank_starts_as_a_spawned_one() -> None:
    """Ranks forked from the preloaded server (:mod:`anyspeed.testing.forkserver`) see the
    caller's environment, and their global generators are seeded apart, as spawned ranks'
    are; a call whose environment differs from the server's spawns its ranks."""
    forked = run_distributed(harness_ranks.start_state, 2, fresh=True)
    again = run_distributed(harness_ranks.start_state, 2, fresh=True)
    spawned = run_distributed(harness_ranks.start_state, 2, fresh=True, env={"ANYSPEED_X": "1"})
    assert [r["method"] for r in spawned] == ["spawn", "spawn"]
    if forkserver.usable():
        assert [r["method"] for r in forked] == ["forkserver", "forkserver"]
    for f, s in zip(forked, spawned, strict=True):
        assert s["env"].pop("ANYSPEED_X") == "1"
        # what the rank itself set, alike; a spawned rank also inherits what readline exported
        # in this process below os.environ (pytest imports it), the terminal's size
        assert _strip(f["env"]).items() <= _strip(s["env"]).items()
        assert set(_strip(s["env"])) - set(_strip(f["env"])) <= {"COLUMNS", "LINES"}
        assert _strip(os.environ).items() <= _strip(f["env"]).items()
        assert f["jit_off"] and s["jit_off"]  # Megatron's torch.compile decorators stayed off
    for gen in ("torch", "numpy"):  # not the server's state, in every rank and every call
        draws = [r[gen] for r in forked + again]
        assert len({tuple(d) for d in draws}) == 4, gen
        assert spawned[0][gen] != spawned[1][gen]


@pytest.mark.usefixtures("server_env")
def test_the_server_is_used_only_for_its_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable changed since the server started (a module may have read it on import), or
    one a call adds, sends the call to spawned ranks; so does ``ANYSPEED_TEST_FORKSERVER=0``."""
    if not forkserver.usable():
        pytest.skip("no fork server on this machine (CUDA, an accelerator, or not Linux)")
    ctx, whole = forkserver.context({})
    assert ctx.get_start_method() == "forkserver" and whole == dict(os.environ)
    assert forkserver.context({"ANYSPEED_X": "1"})[1] is None
    monkeypatch.setenv("ANYSPEED_X", "1")
    assert forkserver.context({})[0].get_start_method() == "spawn"
    monkeypatch.delenv("ANYSPEED_X")
    monkeypatch.setenv(forkserver.ENV, "0")
    assert forkserver.context({})[0].get_start_method() == "spawn"


ORPHAN = """
import os, sys
sys.path.insert(0, sys.argv[1])
os.environ["ANYSPEED_SHARED_RANKS"] = "1"
from anyspeed.testing import run_distributed
from helpers import harness_ranks
print(*run_distributed(harness_ranks.pid, 2), flush=True)
os._exit(0)  # as a pytest-xdist worker ends: no atexit hook stops the shared ranks
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_shared_ranks_end_when_their_test_process_dies() -> None:
    """The shared ranks of a test process that ends without stopping them end by themselves,
    forked or spawned (a forked rank's parent, the fork server, stays alive meanwhile)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", ORPHAN, tests],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_running(p) for p in pids), "shared ranks outlived their test process"


def test_a_task_the_ranks_cannot_take_fails_at_once(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A function pickle cannot name raises in the caller, before any rank waits for it; one the
    shared ranks cannot import (its folder joined this process's path after they started) is
    each rank's reported failure. Neither waits for the call's timeout (120 s here): a queue's
    feeder thread used to drop an unpicklable task with a printed error."""
    import importlib.util
    import pickle

    monkeypatch.setenv("ANYSPEED_SHARED_RANKS", "1")
    run_distributed(harness_ranks.pid, 2, timeout=120)  # the shared ranks are up
    (tmp_path / "late_module.py").write_text("def task():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("unnamed_module", tmp_path / "late_module.py")
    unnamed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(unnamed)
    t0 = time.monotonic()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        run_distributed(unnamed.task, 2, timeout=120)
    assert time.monotonic() - t0 < 10
    monkeypatch.syspath_prepend(str(tmp_path))
    import late_module

    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="No module named 'late_module'"):
        run_distributed(late_module.task, 2, timeout=120)
    assert time.monotonic() - t0 < 30


def test_a_tensor_argument_reaches_every_shared_rank(monkeypatch) -> None:  # noqa: ANN001
    """A tensor argument goes to shared ranks through a file descriptor each rank receives once:
    every rank gets its own (one pickled copy for all ranks reached only the first)."""
    import torch

    monkeypatch.setenv("ANYSPEED_SHARED_RANKS", "1")
    t = torch.arange(1000, dtype=torch.float64)
    assert run_distributed(harness_ranks.total, 2, timeout=120, t=t) == [499500.0] * 2
