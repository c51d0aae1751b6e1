"""LoRA on MoE experts (``--lora-target-modules linear_fc1 linear_fc2`` on a MoE model): one
adapter pair per expert, as MindSpeed-LLM's Qwen3-30B-A3B / DeepSeek-V3 / GLM-4.5 LoRA recipes
train.

References, independent of the adapters' code:
- transformers' Qwen3-MoE forward of the merged export (each expert's weight plus
  ``alpha / r * B_e A_e``) gives the adapted Megatron model's logits, for sequential experts
  and for ``--moe-grouped-gemm`` alike;
- one process for every parallel layout (EP2, TP2 with expert TP 2 and 1, DP2), over steps
  where the adapters move;
- sequential and grouped experts train alike, and a run resumed from a LoRA checkpoint equals
  the run straight through.
"""

from __future__ import annotations

import pytest
import torch
from test_sft_loss import cli

from anyspeed.commands.convert import main as convert
from anyspeed.testing import run_distributed
from helpers import lora_ranks, sft_ranks

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
R, ALPHA = 4, 8.0
TOL = 1e-5


@pytest.fixture(scope="module")
def moe_base(tiny_moe, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE as a Megatron checkpoint."""
    base = str(tmp_path_factory.mktemp("moe_base") / "base")
    hf_to_mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", tiny_moe]
    assert convert([*hf_to_mg, "--save-dir", base]) == 0
    return base


def _hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_expert_adapters_merge_into_transformers(moe_base, tiny_moe, tmp_path, grouped):
    tokens = torch.randint(0, 700, (2, 16), generator=torch.Generator().manual_seed(1))
    lora = str(tmp_path / "lora")
    experts = ["linear_fc1", "linear_fc2"]  # every layer is MoE: the experts' adapters only
    logits = lora_ranks.adapter_checkpoint(moe_base, lora, experts, R, ALPHA, tokens, grouped)
    out = str(tmp_path / "merged")
    mg_to_hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", moe_base]
    assert convert([*mg_to_hf, "--save-dir", out, "--lora-load", lora]) == 0
    want = logits[..., :768].float()
    assert (_hf_logits(out, tokens) - want).abs().max() < 1e-4
    assert (_hf_logits(tiny_moe, tokens) - want).abs().max() > 1e-2  # the adapters count


LAYOUTS = {
    name: flags.split()
    for name, flags in {
        "grouped": "--moe-grouped-gemm",
        "ep2": "--expert-model-parallel-size 2",
        "ep2-grouped": "--expert-model-parallel-size 2 --moe-grouped-gemm",
        "tp2-sp": "--tensor-model-parallel-size 2 --sequence-parallel",
        "tp2-sp-etp1": "--tensor-model-parallel-size 2 --sequence-parallel "
        "--expert-tensor-parallel-size 1",
        "tp2-sp-grouped": "--tensor-model-parallel-size 2 --sequence-parallel --moe-grouped-gemm",
        "tp2-sp-ep2-etp1": "--tensor-model-parallel-size 2 --sequence-parallel "
        "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1",
        "dp2": "--use-distributed-optimizer",
        "pp2": "--pipeline-model-parallel-size 2",
    }.items()
}
FAST = ("ep2-grouped",)  # the rest are -m slow


def lora_cli(hf: str, prefix: str, *extra: str, iters: int = 3) -> list[str]:
    base = cli(hf, prefix, "--lora-r", str(R), "--lora-alpha", str(ALPHA),
               "--lora-target-modules", *TARGETS, "--lr", "2e-2", *extra)  # fmt: skip
    return [str(iters) if base[i - 1] == "--train-iters" else a for i, a in enumerate(base)]


def _run(hf: str, argv: list[str], ranks: int) -> dict:
    from anyspeed.convert import hf_cache as hf_load

    flags = hf_load.expand(argv, hf)  # the adaptor sees the MoE architecture flags
    return run_distributed(sft_ranks.posttrain, ranks, argv=flags, cli=argv, timeout=600)[0]


@pytest.fixture(scope="module")
def one_process(tiny_moe, sft_data) -> dict:
    return _run(tiny_moe, lora_cli(tiny_moe, sft_data["padded"]), 1)


def _same(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in LAYOUTS],
)
def test_lora_on_experts_equals_one_process(layout, one_process, tiny_moe, sft_data):
    assert one_process["loss"][-1] < one_process["loss"][0]  # the adapters learn
    argv = lora_cli(tiny_moe, sft_data["padded"], *LAYOUTS[layout])
    _same(_run(tiny_moe, argv, 1 if layout == "grouped" else 2), one_process)


def test_resumed_at_another_layout_equals_straight(one_process, tiny_moe, sft_data, tmp_path):
    """2 steps at EP2 with grouped experts, saved (adapters only), then the third step in one
    process with sequential experts: the losses of the run straight through (the distributed
    optimizer's state reshards; the local one's stays at its EP size, as Megatron's does)."""
    half, dist = str(tmp_path / "half"), "--use-distributed-optimizer"
    save = ["--save", half, "--save-interval", "2", "--exit-interval", "2"]
    first = lora_cli(tiny_moe, sft_data["padded"], *LAYOUTS["ep2-grouped"], dist, *save)
    assert _run(tiny_moe, first, 2)["iterations"] == [1, 2]
    rest = _run(tiny_moe, lora_cli(tiny_moe, sft_data["padded"], "--lora-load", half, dist), 1)
    assert rest["iterations"] == [3]
    assert rest["loss"] == pytest.approx(one_process["loss"][2:], rel=TOL)
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(f"{half}/iter_0000002")
    model = {k: v for k, v in meta.items() if not k.startswith("optimizer.")}
    assert model and all(".lora_" in k for k in model)
    fc1 = model["decoder.layers.0.mlp.experts.experts.linear_fc1.lora_B"]
    assert tuple(fc1.global_shape) == (4, 2 * 64, R)  # 4 experts, [gate; up] rows of 64 each


def test_peft_applies_the_expert_adapter_export(moe_base, tiny_moe, tmp_path):
    """``--save-lora-to-hf``: PEFT applies the export (attention modules by name, the stacked
    experts by ``target_parameters``) onto transformers' model, giving the adapted logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 700, (2, 16), generator=torch.Generator().manual_seed(2))
    lora = str(tmp_path / "lora")
    logits = lora_ranks.adapter_checkpoint(moe_base, lora, TARGETS, R, ALPHA, tokens)
    out = str(tmp_path / "peft")
    mg_to_hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", moe_base]
    assert convert([*mg_to_hf, "--save-dir", out, "--lora-load", lora, "--save-lora-to-hf"]) == 0
    base = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        got = model(input_ids=tokens).logits.float()
    assert (got - logits[..., :768].float()).abs().max() < 1e-4


@pytest.mark.parametrize(
    "grouped",
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["sequential-rollout-at-tp1", "grouped"],
)
def test_grpo_lora_on_experts_at_ep2(add_prompts, hf_tok, tiny_moe, grouped):
    """GRPO-LoRA on every expert (with the KL to the adapters-off reference) at EP2 against the
    same in one process: the same rollouts, loss and grad norm. Sequential experts roll out
    at TP1 x DP2 (the adapters move with their experts); grouped ones, whose rollouts stay at
    the training layout, adapt the experts only (no layer hook: the adapters are the grouped
    forward's own terms, in decoding too)."""
    from test_grpo import cli as grpo_cli
    from test_grpo_layouts import RUN
    from test_grpo_reshard import INFER

    targets = ["linear_fc1", "linear_fc2", "--moe-grouped-gemm"] if grouped else TARGETS
    lora = ["--lora-r", str(R), "--lora-target-modules", *targets]
    argv = grpo_cli(tiny_moe, add_prompts, hf_tok, *RUN, *lora, "--init-kl-coef", "0.05", iters=4)
    want = _run(tiny_moe, argv, 1)
    got = _run(
        tiny_moe, [*argv, "--expert-model-parallel-size", "2", *([] if grouped else INFER)], 2
    )
    m, ref = got["metrics"], want["metrics"]
    assert m["grpo/rewards/mean"] == ref["grpo/rewards/mean"]
    assert m["response_length/mean"] == ref["response_length/mean"]
    _same(got, want)
    assert max(m["rollout/logp_mismatch_max"]) <= TOL  # the rollout's model is training's
    assert grouped or m["timing/reshard"][0] > 0  # weights moved to the rollout layout
