"""The one-process runs of the memory features, shared by the parity and estimator tests."""

from __future__ import annotations

import pytest

from helpers.memory_cases import CASES, EXTRA_CASES, FP8_CASES, run_cases


@pytest.fixture(scope="session")
def one_process() -> dict:
    return run_cases(1, {}, {**CASES, **EXTRA_CASES, **FP8_CASES})
