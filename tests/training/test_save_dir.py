"""One run per ``--save`` directory, and every replace recoverable: a second run is refused with
one line naming the holder's pid (and removes nothing of the first run's), the lock goes with
its process (kill -9 included), and a kill between the two renames that replace an iteration
leaves the tracker's checkpoint loadable (the copy being replaced is put back)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from anyspeed.checkpoint.files import TRACKER, lock_holder, remove_stale
from anyspeed.checkpoint.reads import tracked_dir
from anyspeed.commands.train import pretrain as main
from helpers.inprocess import clean_after

MOCK = ("--model tiny-qwen2.5 --num-layers 2 --mock-data --vocab-size 512 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --no-progress-bar "
        "--eval-iters 0 --log-interval 1").split()  # fmt: skip


@pytest.fixture(autouse=True)
def _clean():
    with clean_after():  # the runs below train in this process
        yield


def _holder(save: str) -> subprocess.Popen:
    """Another process holding ``save``'s lock (as a running job's rank 0 does)."""
    code = ("import sys, time; from anyspeed.checkpoint.files import lock_dir; "
            "lock_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)")  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", code, save], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_is_one_line_and_removes_nothing(tmp_path, capsys):
    save = str(tmp_path / "ck")
    os.makedirs(os.path.join(save, "iter_0000004.tmp"))  # the first run's save in progress
    first = _holder(save)
    try:
        assert main([*MOCK, "--train-iters", "1", "--save", save]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"is in use by another run (pid {first.pid})" in err
        assert os.path.isdir(os.path.join(save, "iter_0000004.tmp"))
    finally:
        first.send_signal(signal.SIGKILL)  # kill -9: the kernel releases the lock
        first.wait()
    deadline = time.monotonic() + 5
    while lock_holder(save) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock_holder(save) is None
    assert main([*MOCK, "--train-iters", "1", "--save", save]) == 0
    assert not os.path.exists(os.path.join(save, "iter_0000004.tmp"))  # now stale: cleared


def test_a_kill_between_the_renames_loses_nothing(tmp_path, capsys):
    """Saving iteration 2 again over an existing iteration 2: killed after the old copy was
    set aside and before the new one moved in, the directory holds ``iter_0000002.old`` and
    ``.tmp`` and no ``iter_0000002``. Loading takes the old copy; the next save's cleanup puts
    it back instead of deleting it."""
    save = str(tmp_path / "ck")
    assert main([*MOCK, "--train-iters", "2", "--save", save]) == 0
    final = os.path.join(save, "iter_0000002")
    os.replace(final, final + ".old")
    os.makedirs(final + ".tmp")  # the new copy, written but not yet renamed
    assert tracked_dir(save) == final + ".old"
    capsys.readouterr()
    assert main([*MOCK, "--train-iters", "3", "--load", save, "--save", save]) == 0
    assert "loaded " + save + " at iteration 2" in capsys.readouterr().out
    assert open(os.path.join(save, TRACKER)).read().strip() == "3"
    assert os.path.isdir(final) and not os.path.exists(final + ".old")
    assert not os.path.exists(final + ".tmp")


def test_remove_stale_restores_or_clears(tmp_path):
    root = tmp_path
    for name in ("iter_0000003.old", "iter_0000005.old", "iter_0000005", "iter_0000007.tmp"):
        os.makedirs(root / name)
    (root / "iter_0000003.old" / "marker").write_text("whole")
    removed = remove_stale(root)
    assert sorted(removed) == ["iter_0000003.old", "iter_0000005.old", "iter_0000007.tmp"]
    assert (root / "iter_0000003" / "marker").read_text() == "whole"  # put back
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000005"]
