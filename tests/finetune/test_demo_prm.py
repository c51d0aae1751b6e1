"""``anyspeed demo --prm``: its data (fast): labels by the exact rule, and the PRM's training
text laid out as GRPO's process reward model reads a sampled answer after its prompt; and the
whole demo (slow): the PRM beats a constant answer and GRPO on its scores alone raises the
policy's right steps."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from anyspeed.demo import prm
from helpers.corpora import read_back, write_jsonl
from helpers.instruction import preprocess


def test_labels_follow_the_exact_rule():
    """Each written step is labelled "+" exactly when b = a + 1 and a is the number written
    before it (checked here line by line); about a third are wrong."""
    recs, sft = prm.records(300, list(range(50)), 3)
    wrong = 0
    for r, s in zip(recs, sft, strict=True):
        total = int(re.findall(r"\d+", s["instruction"])[0])
        for line, label in zip(s["output"].split("\n"), r["value"], strict=True):
            a, b = map(int, re.fullmatch(r"(-?\d+) \+ 1 = (-?\d+)", line).groups())
            assert a == total and (label == "+") == (b == a + 1)
            wrong += label == "-"
            total = b
        assert prm.right_steps(s["instruction"], s["output"])[0] == r["value"].count("+")
    assert 0.25 < wrong / (3 * len(recs)) < 0.42


def test_prm_text_is_what_grpo_scores(hf_tok, auto_tok, tmp_path):
    """The PRM's training sequence of a solution is token for token the prompt as the RL
    prompt handler writes it, then the answer as the process reward model marks it."""
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.stages.common.rl.process_reward import PRMSource
    from anyspeed.stages.common.rl.step_scores import steps_of, with_steps

    recs, sft = prm.records(4, list(range(10)), 4)
    prompts = [dict(s, output="x") for s in sft]
    src = write_jsonl(str(tmp_path / "p.jsonl"), prompts)
    prefix = preprocess(src, str(tmp_path / "p"), hf_tok, "--prompt-type", "chatml",
                        handler="R1AlpacaStyleInstructionHandler")  # fmt: skip
    tok = load_tokenizer(TokenizerSpec(name_or_path=hf_tok))
    source = PRMSource("", None, prm.PLACEHOLDER, 0, (1, 2), "\n", "min", 1.0)
    for r, s, ids in zip(recs, sft, read_back(f"{prefix}_packed_input_ids_document"),
                         strict=True):  # fmt: skip
        answer = auto_tok(s["output"], add_special_tokens=False)["input_ids"]
        steps, _ = steps_of(tok, answer, set(), source)
        assert auto_tok(r["input"], add_special_tokens=False)["input_ids"] == ids + with_steps(
            tok, steps, source
        )


@pytest.mark.slow
def test_prm_demo_trains_a_prm_and_grpo_on_it(tmp_path):
    cmd = [sys.executable, "-m", "anyspeed", "demo", "--prm", "--workdir", str(tmp_path),
           "--corpus-mb", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("demo: the PRM's held-out"))
    acc, plus = map(float, re.findall(r"\d\.\d+", line))
    assert acc > plus + 0.1, line
    line = next(x for x in out.stdout.splitlines() if x.startswith("demo: the PRM's mean step"))
    r0, r1, before, after = map(float, re.findall(r"\d\.\d+", line.replace("5 steps", "")))
    assert r1 > r0 and after > before, line
    assert all(x.startswith("anyspeed") for x in out.stderr.splitlines()), out.stderr
