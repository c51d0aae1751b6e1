"""``anyspeed generate`` / ``anyspeed evaluate`` from the command line: bad input is one line
before any process group (default run); end to end at TP2 against transformers (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anyspeed.commands import evaluate, generate
from helpers.convert_ranks import tiny_hf_model
from helpers.eval_fixtures import write_mmlu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, hf_tok: str) -> str:
    """A tiny random Qwen2.5 directory with the shared test tokenizer."""
    d = tmp_path_factory.mktemp("cli") / "hf"
    tiny_hf_model(d, "tiny-qwen2.5", seed=1, vocab_size=600)
    for name in os.listdir(hf_tok):
        shutil.copy(os.path.join(hf_tok, name), d / name)
    return str(d)


def _error(capsys, main, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line(capsys, hf_dir: str, tmp_path: Path) -> None:
    ev, gen = evaluate.main, generate.main
    load = ["--load", hf_dir]
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    cases = [
        (ev, [*load, "--task", "mmlu", "--task-data-path", str(tmp_path / "none")],
         "--task-data-path"),
        (ev, [*load, "--task", "boolq"], "--task boolq needs --task-data-path"),
        (ev, [*load, "--task", "bbh", "--task-data-path", str(tmp_path)], "no BBH task .json"),
        (ev, [*load, "--task", "mmlu", "--task-data-path", str(tmp_path), "--chain-of-thought"],
         "--chain-of-thought is for --task bbh"),
        (gen, [*load, "--prompt", "hi", "--num-layers", "7"],
         "--num-layers 7 does not match the checkpoint (2)"),
        (gen, [*load, "--prompt", "word " * 40, "--max-length", "16"], "longer than the context"),
        (gen, [*load, "--prompt", "hi", "--tensor-model-parallel-size", "3"], "does not divide"),
        (gen, ["--load", str(tmp_path / "nope"), "--prompt", "hi"], "no such directory"),
        (gen, [*load, "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (gen, [*load, "--task", "greedy"], "needs --prompt or --prompts-file"),
        (gen, [*load, "--prompts-file", str(blank)], "holds no prompt (every line empty)"),
        (gen, [str(tmp_path)], "--load"),
    ]  # fmt: skip
    for main, argv, message in cases:
        err = _error(capsys, main, argv)
        assert err.startswith("anyspeed ") and message in err, (argv, err)


def _cli(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "anyspeed", *argv], capture_output=True,
                          text=True, env=env, input=stdin, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_generate_tp2_equals_transformers(hf_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model.generation_config.eos_token_id = None
    ids = tok("the quick brown fox")["input_ids"]
    # anyspeed never picks ids past the tokenizer's vocabulary (the model's rows there are
    # random padding); neither may the reference
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                         min_new_tokens=24, pad_token_id=0,
                         suppress_tokens=list(range(len(tok), 600)))  # fmt: skip
    want = tok.decode(ref[0, len(ids) :])
    res = _cli("generate", "--load", hf_dir, "--prompt", "the quick brown fox",
               "--max-new-tokens", "24", "--tensor-model-parallel-size", "2")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"prompt: the quick brown fox\n{want}\n" in res.stdout


@pytest.mark.slow
def test_evaluate_mmlu_json_and_chat(hf_dir: str, tmp_path: Path) -> None:
    write_mmlu(tmp_path / "mmlu", {"anatomy": 3, "virology": 2}, shots=1)
    out = tmp_path / "res.json"
    res = _cli("evaluate", "--load", hf_dir, "--task", "mmlu", "--task-data-path",
               str(tmp_path / "mmlu"), "--num-fewshot", "1", "--evaluation-batch-size", "2",
               "--no-chat-template", "--output-json", str(out),
               "--pipeline-model-parallel-size", "2")  # fmt: skip
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    assert got["total"] == 5 and set(got["groups"]) == {"anatomy", "virology"}
    assert "mmlu (all)" in res.stdout
    chat = _cli("generate", "--load", hf_dir, "--task", "chat", "--prompt-type", "qwen",
                "--max-new-tokens", "8", stdin="hello there\nexit\n")  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert "You >> " in chat.stdout and "anyspeed >> " in chat.stdout
