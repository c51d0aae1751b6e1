"""Multi-turn GRPO with tool calls end to end on a tiny Qwen2 trained to call ``multiply``
(``helpers.tool_model``; its prompts carry their tools, TRL's layout): greedy trajectories
(tokens and the tool mask) equal TRL's ``GRPOTrainer(tools=[...])`` rollout for 1, 2 and 3
calls (skipped without TRL), each later turn extending the KV cache; a rollout model at TP1
under TP2 training gives the same trajectories; the rollout's log-probs equal the training
forward's across turns as closely as a single turn's (fp32) at one process, TP2+SP and PP2;
loss and grad norm at TP2+SP, PP2 and DP2 equal one process within 1e-5. All ``-m slow``: the
tool model takes ~40 s to train."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_grpo import cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers import tool_model as TM
from helpers.corpora import write_jsonl
from helpers.instruction import preprocess

pytestmark = pytest.mark.slow
TOOLS = ["--tools", "helpers.user_tools:multiply"]
RUN = [*TOOLS, "--seq-length", "480", "--max-response-length", "128", "--top-k", "1",
       "--n-samples-per-prompt", "2", "--global-batch-size", "6", "--micro-batch-size", "1",
       "--verifier-function", "helpers.user_rewards:digits", "--init-kl-coef", "0"]  # fmt: skip


def qwen_template() -> str | None:
    """Qwen2.5's chat template as TRL ships it (TRL parses tool calls of templates it knows);
    None without TRL (anyspeed's own template then)."""
    try:
        import trl
    except ImportError:
        return None
    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory) -> dict:
    """The tool tokenizer, the trained model and the three questions as prompt data."""
    d = tmp_path_factory.mktemp("tools")
    tok = TM.tokenizer(str(d / "tok"), qwen_template())
    model = TM.train(tok, str(d / "model"))
    src = write_jsonl(str(d / "q.jsonl"), TM.prompt_records())
    prefix = preprocess(src, str(d / "q"), tok, "--prompt-type", "hf",
                        handler="R1AlpacaStyleInstructionHandler")  # fmt: skip
    return {"tok": tok, "model": model, "prefix": prefix}


def argv(t: dict, *extra: str) -> list[str]:
    return cli(t["model"], t["prefix"], t["tok"], *RUN, *extra)


@pytest.mark.parametrize("calls", [1, 2, 3])
def test_trajectories_equal_trl(tool_run, calls, tmp_path):
    pytest.importorskip("trl")
    from helpers.trl_reference import trl_rollout

    got = run_distributed(sft_ranks.tool_trajectories, 1, argv=argv(tool_run),
                          cli=argv(tool_run, "--max-tool-calls", str(calls)),
                          rows=[0, 1, 2], timeout=300)[0]  # fmt: skip
    want = trl_rollout(tool_run["model"], tool_run["tok"], TM.QUESTIONS, calls, 128, str(tmp_path))
    assert got["calls"] == 6 * calls  # two (greedy, equal) samples per question
    # each later turn (a tool turn followed by the model's tokens) extended the KV cache
    assert got["resumed"] == max(_turns_after_tools(m) for m in want["tool_mask"])
    for i in range(6):
        assert got["prompts"][i] == want["prompt_ids"][i // 2], i
        assert got["tokens"][i] == want["completion_ids"][i // 2], i
        assert got["masks"][i] == want["tool_mask"][i // 2], i


def _turns_after_tools(mask: list[int]) -> int:
    """How many times the model's tokens follow a tool turn's in a tool mask."""
    return sum(a == 0 and b == 1 for a, b in zip(mask, mask[1:], strict=False))


def test_rollout_model_at_tp1_keeps_each_ranks_share(tool_run):
    """Training at TP2 rolling out at TP1 (each rank decodes half the samples with the whole
    model): the same trajectories as one process, each rank extending its own rows' cache."""
    from test_grpo_reshard import INFER

    one = argv(tool_run, "--max-tool-calls", "2")
    want = run_distributed(sft_ranks.tool_trajectories, 1, argv=one, cli=one, rows=[0, 1, 2],
                           timeout=300)[0]  # fmt: skip
    two = one + ["--tensor-model-parallel-size", "2", *INFER]
    ranks = run_distributed(sft_ranks.tool_trajectories, 2, argv=two, cli=two, rows=[0, 1, 2],
                            timeout=400)  # fmt: skip
    for rank, got in enumerate(ranks):  # rank r decodes samples 3r..3r+2 of the six
        mine = want["masks"][3 * rank : 3 * rank + 3]
        assert got["resumed"] == max(_turns_after_tools(m) for m in mine)
        assert got["tokens"] == want["tokens"]
        assert got["masks"] == want["masks"]


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
}
STEPS = ["--rollout-batch-size", "2", "--global-batch-size", "4", "--lr-decay-style",
         "constant", "--ppo-epochs", "2"]  # fmt: skip


MISMATCH = 5e-6  # fp32, ~300-token sequences; single-turn on this model measures 2.7e-6


def test_layouts_equal_one_process_across_turns(tool_run):
    """Two rollouts of two questions (mu = 2: four steps): losses and grad norms within 1e-5 of
    one process, tools called, and the rollout's log-probs the training forward's over every
    model token of every turn as closely as a single-turn rollout's (the KV-cache decode's fp32
    error at this length: within 5e-6 and 1.5x the single-turn run's)."""
    one = argv(tool_run, *STEPS, "--train-iters", "4")
    single = [x for x in one if x not in TOOLS]
    want, flat = run_distributed(sft_ranks.posttrain_many, 1, argv=one, clis=[one, single],
                                 timeout=400)[0]  # fmt: skip
    argvs = [argv(tool_run, *STEPS, "--train-iters", "4", *f) for f in LAYOUTS.values()]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=900)
    assert min(want["metrics"]["tools/calls_per_sample"]) >= 1
    bound = min(MISMATCH, 1.5 * max(flat["metrics"]["rollout/logp_mismatch_max"]))
    assert max(want["metrics"]["rollout/logp_mismatch_max"]) <= bound
    for i, name in enumerate(LAYOUTS):
        got = out[0][i]
        assert got["metrics"]["tools/calls_per_sample"] == want["metrics"]["tools/calls_per_sample"]
        assert max(got["metrics"]["rollout/logp_mismatch_max"]) <= bound, name
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), name
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name


def test_ppo_with_tools(tool_run):
    """PPO's rollouts are the same multi-turn ones: its critic values the model's tokens (GAE
    steps over the tool turns) and both models train."""
    ppo = argv(tool_run, *STEPS, "--train-iters", "2")
    ppo[ppo.index("--stage") + 1] = "ppo"
    (h,) = run_distributed(sft_ranks.posttrain, 1, argv=ppo, cli=ppo, timeout=400)
    m = h["metrics"]
    assert min(m["tools/calls_per_sample"]) >= 1
    assert max(m["critic/grad_norm"]) > 0 and all(abs(x) < 1e6 for x in m["critic/vf_loss"])
    assert max(h["grad_norm"]) > 0
