"""The multi-turn loop (``--tools``) against an independent reference, with a scripted model
(each call returns the next assistant turn of a known conversation): the sequence equals the
conversation rendered whole by the tokenizer's chat template and cut into pieces (prompt,
assistant turns, tool turns), the mask is 1 exactly on the assistant turns, the tools' answers
are the real tool's, a tool turn past the answer budget ends the sample, ``--max-tool-calls``
bounds the turns; and in the loss the gradient at tool-turn positions is exactly 0."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from helpers import tool_model as TM


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory) -> str:
    return TM.tokenizer(str(tmp_path_factory.mktemp("tool-tok")))


@dataclass
class Req:
    max_new_tokens: int = 64
    row_seeds: tuple | None = None
    lockstep: bool = False


class Scripted:
    """A sampler that writes each conversation's assistant turns in order (1-3 calls)."""

    def __init__(self, tok, convs: list[list[dict]]) -> None:
        self.turns = {}
        for msgs in convs:
            ps = TM.pieces(tok, msgs)
            self.turns[tuple(ps[0][0])] = [p for p, model in ps if model]
        self.calls: dict[tuple, int] = {}

    def __call__(self, prompts, req, kept=None):
        out = []
        for p in prompts:
            key = next(k for k in self.turns if tuple(p[: len(k)]) == k)
            n = self.calls.get(key, 0)
            self.calls[key] = n + 1
            out.append(self.turns[key][n][: req.max_new_tokens])
        return out, [[-0.5] * len(t) for t in out]


def loop(tool_tok, max_turns=4, max_response=400):
    from transformers import AutoTokenizer

    from anyspeed.data.tokenizer import TokenizerSpec, end_ids, load_tokenizer
    from anyspeed.stages.common.rl.multiturn import ToolTurns
    from anyspeed.stages.common.rl.tools import Toolbox

    tok = load_tokenizer(TokenizerSpec("PretrainedFromHF", tool_tok))
    hf = AutoTokenizer.from_pretrained(tool_tok)
    factors = [(12, 34), (7, 8, 9), (3, 4, 5, 6)]  # 1, 2 and 3 calls
    convs = [TM.conversation(q, f) for q, f in zip(TM.QUESTIONS, factors, strict=True)]
    box = Toolbox(["helpers.user_tools:multiply"], 5.0, 512, "left")
    turns = ToolTurns(tok, box, end_ids(tok), max_turns, max_response, 1024)
    return turns, Scripted(hf, convs), hf, convs


def test_trajectories_equal_the_conversations_rendered_whole(tool_tok):
    turns, model, hf, convs = loop(tool_tok)
    prompts = [TM.pieces(hf, c)[0][0] for c in convs]
    first, lps = model(prompts, Req())
    got = turns.run(model, prompts, first, lps, Req())
    for i, msgs in enumerate(convs):
        ps = TM.pieces(hf, msgs)
        want = [t for p, _ in ps[1:] for t in p]
        mask = [int(m) for p, m in ps[1:] for _ in p]
        assert got.tokens[i] == want, i
        assert got.masks[i] == mask, i
        assert [lp for lp, m in zip(got.logps[i], mask, strict=True) if not m] == [0.0] * (
            len(mask) - sum(mask)
        )
        assert got.tokens[i][got.last[i] :] == ps[-1][0]  # the last turn: the product
    assert got.stats.calls == 1 + 2 + 3 and got.stats.errors == 0 and got.stats.samples == 3


def test_budget_and_turn_limits_end_a_sample(tool_tok):
    turns, model, hf, convs = loop(tool_tok, max_turns=1)
    prompts = [TM.pieces(hf, c)[0][0] for c in convs]
    first, lps = model(prompts, Req())
    got = turns.run(model, prompts, first, lps, Req())
    for i, msgs in enumerate(convs):  # one tool turn, then the next assistant turn
        want = [t for p, _ in TM.pieces(hf, msgs)[1:4] for t in p]
        assert got.tokens[i] == want, i
    turns, model, hf, convs = loop(tool_tok, max_response=len(first[0]) + 3)
    first, lps = model(prompts, Req())
    got = turns.run(model, prompts, first, lps, Req())
    assert got.tokens == first and got.stats.calls == 3  # answered, but no room for the turn


def test_no_gradient_at_tool_positions():
    """The policy loss of micro-batches built from a rollout with a tool turn: its gradient
    with respect to every position's log-prob is exactly 0 inside the tool turn."""
    from types import SimpleNamespace

    from anyspeed.stages.common.rl import objective as L
    from anyspeed.stages.common.rl.batches import Rollout, micro_batches

    answer = [5, 6, 7, 8, 9, 10, 11]
    model_mask = [1, 1, 0, 0, 0, 1, 1]
    roll = Rollout([[1, 2, 3]], [answer], [[-1.0] * 7], torch.tensor([1.0]),
                   torch.tensor([0.7]), 1, 1, [model_mask])  # fmt: skip
    sizes = dict.fromkeys(("tensor", "pipeline", "expert"), 1)
    args = SimpleNamespace(seq_length=32, micro_batch_size=1,
                           **{f"{k}_model_parallel_size": v for k, v in sizes.items()})  # fmt: skip
    (b,) = micro_batches(roll, args, 0, torch.device("cpu"))
    logp = (torch.randn(b["tokens"].shape) - 1).requires_grad_()
    mask = b["loss_mask"]
    for level in ("token", "sequence"):  # GSPO's ratio: a mean over the model's tokens only
        log_w = L.log_importance(logp, b["rollout_logp"], mask, level)
        t = L.policy_terms(log_w, b["advantages"], 0.2, 0.2)
        kl = L.kl_penalty(logp, b["rollout_logp"] - 0.1, "low_var_kl")
        ((t["pg"] + 0.05 * kl) * mask).sum().backward()
    first = 2  # the label position of the first answer token (prompt of 3)
    tool = [first + j for j, m in enumerate(model_mask) if not m]
    model = [first + j for j, m in enumerate(model_mask) if m]
    assert (logp.grad[0, tool] == 0).all()
    assert (logp.grad[0, model] != 0).all()


def test_grpo_runs_with_tools_and_reports_them(capsys, tiny_qwen, hf_tok, tmp_path):
    """The stage's path with --tools on prompts whose records carry a tools field (rendered by
    the tokenizer's chat template): the run trains and logs the tool metrics (a random model
    calls no tool: 0 calls per sample); bad tool flags are one line before start."""
    import os

    from test_grpo import cli

    from anyspeed.commands.train import posttrain
    from anyspeed.testing import run_distributed
    from helpers import sft_ranks
    from helpers.corpora import write_jsonl
    from helpers.instruction import preprocess

    short = {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }  # a bare function object: the layout is accepted
    recs = [{"instruction": f"What is {a} * 7?", "output": str(7 * a), "tools": [short]}
            for a in range(10, 18)]  # fmt: skip
    src = write_jsonl(str(tmp_path / "q.jsonl"), recs)
    prefix = preprocess(src, str(tmp_path / "q"), hf_tok, "--prompt-type", "hf",
                        handler="R1AlpacaStyleInstructionHandler")  # fmt: skip
    argv = cli(tiny_qwen, prefix, hf_tok, "--tools", "calculator", "python", "--seq-length",
               "400", "--verifier-function", "helpers.user_rewards:digits")  # fmt: skip
    (hist,) = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)
    m = hist["metrics"]
    for k in ("tools/calls_per_sample", "tools/errors", "tools/timeouts", "tools/time"):
        assert m[k] == [0.0, 0.0], k
    assert all(x > 0 for x in m["response_length/mean"])
    os.environ.pop("WORLD_SIZE", None)
    for bad, says in (
        (["--tools", "nope"], "--tools: unknown tool 'nope'"),
        (["--tools", "calculator", "--max-tool-calls", "0"], "--max-tool-calls"),
    ):
        capsys.readouterr()
        assert posttrain(cli(tiny_qwen, prefix, hf_tok, *bad, "--seq-length", "400")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err


def test_sft_data_with_tool_turns_labels_only_the_assistant(hf_tok, tmp_path):
    """An OpenAI-layout conversation with a tool call and the tool's turn, preprocessed with
    the tokenizer's chat template: the labelled tokens are exactly the assistant turns as the
    template renders them (the tool turn and the prompt are context only)."""
    from transformers import AutoTokenizer

    from helpers.corpora import read_back, write_jsonl
    from helpers.instruction import preprocess

    msgs = TM.conversation("Multiply 12 by 34 by 5.", (12, 34, 5))
    src = write_jsonl(str(tmp_path / "c.jsonl"), [{"messages": msgs, "tools": [TM.tool_schema()]}])
    prefix = preprocess(src, str(tmp_path / "c"), hf_tok, "--prompt-type", "hf",
                        handler="OpenAIStyleInstructionHandler")  # fmt: skip
    tok = AutoTokenizer.from_pretrained(hf_tok)
    labels = [t for t in read_back(f"{prefix}_packed_labels_document")[0] if t >= 0]
    want = ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            head = tok.apply_chat_template(msgs[:i], tools=[TM.tool_schema()], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
            full = tok.apply_chat_template(msgs[: i + 1], tools=[TM.tool_schema()],
                                           tokenize=False)  # fmt: skip
            want += full[len(head) :]
    assert tok.decode(labels) == want
    assert want.count("<tool_call>") == 2 and "<|im_start|>tool" not in want
