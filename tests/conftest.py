"""Shared fixtures for every test area, and the ``helpers`` package on the path.

Areas: ``device/``, ``features/``, ``models/``, ``training/``, ``data/``, ``convert/``, ``cli/``;
``helpers/`` holds what several areas use: generated corpora and tokenizers (``corpora``) and
the functions spawned ranks run (``*_ranks``, importable by name so spawn can pickle them).
"""

import os
import sys

import pytest

# Keep each test process small on a 2-core machine; spawned ranks set their own thread counts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Distributed tests share their ranks (anyspeed.testing.pool): starting a rank costs seconds.
os.environ.setdefault("ANYSPEED_SHARED_RANKS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ``import helpers...``

# Megatron-Core as anyspeed's commands and ranks import it: off CUDA its jit_fuser is a no-op
# (test modules import it at collection, before any adaptor is applied).
from anyspeed.device.jit import keep_megatron_jit_off  # noqa: E402

keep_megatron_jit_off(unless_cuda=True)


@pytest.fixture(scope="session", name="hf_tok")
def hf_tok_fixture(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE (vocab 600) trained by ``train-tokenizer`` on a generated corpus."""
    from helpers.corpora import train_tokenizer

    return train_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="session", name="auto_tok")
def auto_tok_fixture(hf_tok: str):  # noqa: ANN201 - a transformers tokenizer
    """The same tokenizer loaded independently through transformers.AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_tok)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the shared ranks here: a pytest-xdist worker ends without running atexit hooks."""
    from anyspeed.testing import pool

    pool.close_all()
