"""The marks of tests that need a Megatron-LM checkout: ``$ANYSPEED_MEGATRON_LM`` at tag
core_v0.16.1 (skipped when it is not set)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MLM = os.environ.get("ANYSPEED_MEGATRON_LM")
MARKS = [
    pytest.mark.megatron_lm,
    pytest.mark.skipif(
        not MLM or not Path(MLM, "pretrain_gpt.py").is_file(),
        reason="set ANYSPEED_MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1)",
    ),
]
