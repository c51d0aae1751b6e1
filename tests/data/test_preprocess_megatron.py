"""anyspeed preprocess vs. Megatron-LM's own tools/preprocess_data.py: identical files.

Needs a Megatron-LM checkout (tag core_v0.16.1) at ANYSPEED_MEGATRON_LM; skipped when absent.
Megatron's tool imports megatron.training, so it runs behind the one anyspeed line, exactly as a
user would run it on a machine without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.corpora import make_docs, run_cli, write_jsonl

MLM = os.environ.get("ANYSPEED_MEGATRON_LM")
pytestmark = [
    pytest.mark.megatron_lm,
    pytest.mark.skipif(
        not MLM or not Path(MLM, "tools", "preprocess_data.py").is_file(),
        reason="set ANYSPEED_MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1)",
    ),
]

RUNNER = (
    "import runpy, sys, torch\n"
    "import anyspeed.megatron_adaptor\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_same_bytes_as_megatron_preprocess_data(tmp_path, capsys, hf_tok, workers):
    corpus = write_jsonl(str(tmp_path / "c.jsonl"), [{"text": d} for d in make_docs(300, 5)])
    env = dict(os.environ, PYTHONPATH=MLM, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(Path(MLM, "tools", "preprocess_data.py")),
         "--input", corpus, "--output-prefix", str(tmp_path / "mlm"),
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_tok,
         "--append-eod", "--workers", workers],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, _ = run_cli(capsys, "preprocess", "--input", corpus, "--output-prefix",
                      str(tmp_path / "any"), "--tokenizer-name-or-path", hf_tok,
                      "--append-eod", "--workers", workers)  # fmt: skip
    assert code == 0
    for ext in ("bin", "idx"):
        mine = (tmp_path / f"any_text_document.{ext}").read_bytes()
        theirs = (tmp_path / f"mlm_text_document.{ext}").read_bytes()
        assert mine == theirs, ext
