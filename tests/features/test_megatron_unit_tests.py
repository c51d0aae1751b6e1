"""Megatron-Core's own unit tests under anyspeed (``scripts/megatron_tests.sh``): the summary's
merging and classification (fast), and a sample of Megatron-LM's tests run by the script when
a checkout is at hand (``ANYSPEED_MEGATRON_LM``, tag core_v0.16.1; skipped otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from anyspeed.testing.megatron_report import merged, report
from anyspeed.testing.megatron_table import cuda_only_reason, known_skip

ROOT = Path(__file__).resolve().parents[2]
MLM = os.environ.get("ANYSPEED_MEGATRON_LM")


def test_only_cuda_only_imports_become_skips():
    try:
        import transformer_engine  # noqa: F401
    except ImportError as exc:
        assert (
            cuda_only_reason(exc) == "needs transformer_engine (CUDA-only package, not installed)"
        )
    try:
        try:
            import apex.normalization  # noqa: F401
        except ImportError as inner:
            raise RuntimeError("could not build the layer") from inner
    except RuntimeError as exc:  # the cause is what counts
        assert cuda_only_reason(exc) == "needs apex (CUDA-only package, not installed)"
    assert cuda_only_reason(ImportError("No module named 'megatron.missing'")) is None
    assert cuda_only_reason(AssertionError("wrong values")) is None
    assert known_skip("tests/unit_tests/tensor_parallel/test_random.py::"
                      "test_double_fork_cuda_rng_states_tracker[True]")  # fmt: skip
    assert not known_skip("tests/unit_tests/tensor_parallel/test_random.py::"
                          "test_double_fork_cuda_rng_states_tracker[False]")  # fmt: skip


def _write(d: Path, name: str, rows: list[dict]) -> None:
    (d / "results").mkdir(exist_ok=True)
    with open(d / "results" / f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_a_test_that_fails_on_any_rank_fails(tmp_path):
    t = "tests/unit_tests/transformer/moe/test_a.py::test_x"
    u = "tests/unit_tests/models/test_b.py::test_y"
    ok = {"when": "call", "outcome": "passed", "reason": "", "seconds": 0.1}
    _write(tmp_path, "a.rank0", [{"test": t, **ok}, {"test": u, **ok}])
    _write(tmp_path, "a.rank1", [{"test": t, **ok, "outcome": "failed", "reason": "boom"},
                                 {"test": u, **ok}])  # fmt: skip
    (tmp_path / "files.tsv").write_text("tests/unit_tests/models/test_c.py\ttimeout after 9s\n")
    tests = merged(tmp_path)
    assert tests[t]["outcome"] == "failed" and tests[u]["outcome"] == "passed"
    text = report(tmp_path)
    assert "transformer" in text and "models" in text
    assert "test_c.py: timeout after 9s" in text and "[unexplained] boom" in text


@pytest.mark.skipif(not MLM, reason="set ANYSPEED_MEGATRON_LM to a Megatron-LM checkout "
                    "(tag core_v0.16.1) to run its tests under anyspeed")  # fmt: skip
def test_a_sample_of_megatron_tests_passes(tmp_path):
    """tensor_parallel's mappings (7 tests on 8 gloo ranks) all pass under the one line."""
    env = {**os.environ, "OUT": str(tmp_path), "NPROC": "8", "FILE_TIMEOUT": "300"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "megatron_tests.sh"), str(MLM),
                          "tensor_parallel"], capture_output=True, text=True, env=env,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    tests = merged(tmp_path)
    mappings = {t: r for t, r in tests.items() if "test_mappings.py" in t}
    assert len(mappings) == 7 and all(r["outcome"] == "passed" for r in mappings.values())
