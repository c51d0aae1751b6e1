"""A pytest plugin that runs Megatron-Core's own unit tests (Megatron-LM ``tests/unit_tests``)
under anyspeed's one line on any device: ``torchrun --nproc-per-node 8 -m pytest -p
anyspeed.testing.megatron FILE`` (``scripts/megatron_tests.sh`` runs it file by file).

What it does, and nothing else: the one line before any test imports Megatron; a Transformer
Engine version of 0 where TE is not installed (Megatron's ``conftest.py`` asks for one); no
download of Megatron's test dataset (no network at run time); ``torch.cuda.is_available()``
true (``torch.cuda`` is this device under the one line); the gloo groups Megatron's
``destroy_model_parallel`` forgets destroyed (:mod:`anyspeed.testing.megatron_groups`);
tests that need CUDA-only packages or kernels skipped with the reason
(:mod:`anyspeed.testing.megatron_table`); and each
rank's outcomes written as JSON lines for the summary (``ANYSPEED_MEGATRON_RESULTS``).
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

import pytest

from anyspeed.testing.megatron_table import cuda_only_reason, known_skip

DATASET_MODULE = "tests.test_utils.python_scripts.download_unit_tests_dataset"


def _te_version_shim() -> None:
    """``is_te_min_version`` compares ``get_te_version()``, which is None without TE."""
    import megatron.core.utils as mcu
    from packaging.version import Version

    if mcu.get_te_version() is None:
        mcu.get_te_version = lambda: Version("0")


def _no_dataset_download() -> None:
    """Megatron's conftest downloads a dataset to /opt/data when it is missing: here it is
    not fetched (its tests then fail or skip on the missing files, and say so)."""

    def download_and_extract_asset(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("anyspeed.testing.megatron: no network at run time")

    mod = types.ModuleType(DATASET_MODULE)
    mod.download_and_extract_asset = download_and_extract_asset  # type: ignore[attr-defined]
    sys.modules.setdefault(DATASET_MODULE, mod)


def pytest_load_initial_conftests(early_config: pytest.Config, parser: Any, args: Any) -> None:
    """Before Megatron's ``conftest.py`` imports Megatron: the one line (what ``import
    anyspeed.megatron_adaptor`` does, with no feature flags), the TE version, no download."""
    from anyspeed import adaptor

    adaptor.apply(argv=[])
    _te_version_shim()
    _no_dataset_download()
    _device_is_cuda()
    from anyspeed.testing import megatron_groups as testing_megatron_groups

    testing_megatron_groups.install()  # hundreds of set-ups per file: keep one set of groups


def _device_is_cuda() -> None:
    """Megatron gates 70 tests on ``torch.cuda.is_available()``; under the one line
    ``torch.cuda`` is this device, so the answer is yes (anyspeed detected its device before
    this, and keeps it). ``ANYSPEED_MEGATRON_CUDA_GATE=off`` leaves torch's answer."""
    import torch

    if os.environ.get("ANYSPEED_MEGATRON_CUDA_GATE", "on") != "off":
        torch.cuda.is_available = lambda: True  # type: ignore[assignment]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with the reason, the tests the table names (they need CUDA-only code)."""
    for item in items:
        reason = known_skip(item.nodeid)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A test that failed only because a CUDA-only package is missing is a skip, with the
    package named; every outcome goes to this rank's results file."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        reason = cuda_only_reason(call.excinfo.value)
        if reason:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
    if report.when == "call" or report.outcome != "passed":
        _record(item, report)


def _record(item: pytest.Item, report: pytest.TestReport) -> None:
    path = os.environ.get("ANYSPEED_MEGATRON_RESULTS")
    if not path:
        return
    text = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.outcome == "failed":
        text = _first_error_line(report)
    rank = os.environ.get("RANK", "0")
    row = {
        "test": item.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "reason": text[:400],
        "seconds": round(report.duration, 2),
    }
    with open(f"{path}.rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _first_error_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        first = crash.message.splitlines()[0] if crash.message else ""
        return f"{first} ({crash.path}:{crash.lineno})"
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""
