"""Quiet by default: a command shows no third-party warning; ANYSPEED_VERBOSE=1 brings them back.

Each check runs a fresh interpreter, since hiding warnings changes process-wide state.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from anyspeed import quiet
from anyspeed.launch import torchrun_env

_MISSING = [m for m in ("transformer_engine", "apex") if importlib.util.find_spec(m) is None]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (quiet.ENV, quiet._SHOWN_ENV, "PYTHONWARNINGS", "RANK")}  # fmt: skip
    return {**env, **extra}


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env=_env(**env))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _third_party(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "Warning" in ln or "warn(" in ln]


@pytest.mark.slow  # two fresh interpreters, 12 s; the record filters stay in CI
def test_features_is_quiet_and_verbose_brings_warnings_back():
    proc = _run(["-m", "anyspeed", "features"])
    assert not _third_party(proc.stdout + proc.stderr), proc.stderr
    notices = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyspeed: ")]
    if _MISSING:  # Megatron announced its fallbacks: anyspeed says so once, in its own words
        assert notices == [quiet.notice()], proc.stderr
        assert "portable local spec" in notices[0] and f"{quiet.ENV}=1" in notices[0]
        loud = _run(["-m", "anyspeed", "features"], ANYSPEED_VERBOSE="1")
        assert any("not installed" in ln for ln in _third_party(loud.stderr)), loud.stderr
        assert quiet.notice() not in loud.stderr


_RECORDS = """
import logging, warnings
from anyspeed import quiet
quiet.install()
log = logging.getLogger("megatron.core.datasets.gpt_dataset")
log.warning("Unable to save GPTDataset indexes because path_to_cache is None")
logging.getLogger("megatron.core.other").warning("a record anyspeed keeps")
warnings.warn_explicit("`torch.distributed.all_gather_into_tensor` is deprecated.",
                       FutureWarning, "/x/torch/distributed/c10d_logger.py", 83)
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                       "/x/megatron/core/models/backends.py", 21)
warnings.warn("a warning anyspeed keeps", UserWarning)
"""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_known_records_and_warnings_hidden_others_kept(rank):
    err = _run(["-c", _RECORDS], RANK=rank).stderr
    assert "a record anyspeed keeps" in err and "a warning anyspeed keeps" in err
    for hidden in ("path_to_cache", "all_gather_into_tensor", "Torch Norm"):
        assert hidden not in err, err
    assert err.count(quiet.notice()) == (1 if rank == "0" else 0), err


def test_a_child_does_not_repeat_the_notice():
    err = _run(["-c", _RECORDS], **{quiet._SHOWN_ENV: "1"}).stderr
    assert quiet.notice() not in err and "Torch Norm" not in err


@pytest.mark.parametrize("value, loud", [("1", True), ("true", True), ("0", False), ("", False)])
def test_verbose_values(value, loud, monkeypatch):
    monkeypatch.setenv(quiet.ENV, value)
    assert quiet.verbose() is loud


def test_torchrun_env_sets_torchruns_own_thread_default(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert torchrun_env(2)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in torchrun_env(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert torchrun_env(2)["OMP_NUM_THREADS"] == "3"
