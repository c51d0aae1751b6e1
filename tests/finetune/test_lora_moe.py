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


def _to_megatron(hf: str, out: str) -> str:
    hf_to_mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf]
    assert convert([*hf_to_mg, "--save-dir", out]) == 0
    return out


@pytest.fixture(scope="module")
def moe_base(tiny_moe, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE as a Megatron checkpoint."""
    return _to_megatron(tiny_moe, str(tmp_path_factory.mktemp("moe_base") / "base"))


@pytest.fixture(scope="module")
def shared_moe(tmp_path_factory) -> dict:
    """A tiny Qwen2-MoE: routed experts beside a gated shared expert (QKV biases too), as an
    HF directory and a Megatron checkpoint."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    d = tmp_path_factory.mktemp("qwen2_moe")
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=768, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, shared_expert_intermediate_size=96,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         norm_topk_prob=False)  # fmt: skip
    Qwen2MoeForCausalLM(cfg).save_pretrained(d / "hf")
    return {"hf": str(d / "hf"), "base": _to_megatron(str(d / "hf"), str(d / "base"))}


def _hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()


@pytest.mark.parametrize(
    "model,grouped",
    [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False)],
    ids=["sequential", "grouped", "shared-expert"],
)
def test_expert_adapters_merge_into_transformers(
    request, moe_base, tiny_moe, tmp_path, model, grouped
):
    """Every layer is MoE, so only the experts' adapters act (and the shared expert's)."""
    if model == "qwen2_moe":
        shared = request.getfixturevalue("shared_moe")
        base, hf = shared["base"], shared["hf"]
    else:
        base, hf = moe_base, tiny_moe
    tokens = torch.randint(0, 700, (2, 16), generator=torch.Generator().manual_seed(1))
    lora = str(tmp_path / "lora")
    experts = ["linear_fc1", "linear_fc2"]
    logits = lora_ranks.adapter_checkpoint(base, lora, experts, R, ALPHA, tokens, grouped)
    out = str(tmp_path / "merged")
    mg_to_hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", base]
    assert convert([*mg_to_hf, "--save-dir", out, "--lora-load", lora]) == 0
    want = logits[..., :768].float()
    assert (_hf_logits(out, tokens) - want).abs().max() < 1e-4
    assert (_hf_logits(hf, tokens) - want).abs().max() > 1e-2  # the adapters count
    if model == "qwen2_moe":
        from megatron.core import dist_checkpointing

        keys = dist_checkpointing.load_tensors_metadata(f"{lora}/iter_0000001")
        assert "decoder.layers.1.mlp.shared_experts.linear_fc2.lora_A" in keys


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
    """``--save-lora-to-hf``: PEFT applies the export (each expert's adapters under its
    checkpoint names, which PEFT converts into transformers 5's stacked experts) onto
    transformers' model, giving the adapted logits."""
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


@pytest.mark.slow
def test_shared_expert_lora_at_tp2_sp_and_ep2(shared_moe, sft_data):
    """Qwen2-MoE (gated shared expert beside the routed ones) with LoRA on every layer: TP2+SP
    (the shared expert's adapters communicate as a dense layer's) and EP2 equal one process."""
    hf = shared_moe["hf"]
    want = _run(hf, lora_cli(hf, sft_data["padded"]), 1)
    assert want["loss"][-1] < want["loss"][0]
    for layout in ("tp2-sp", "ep2"):
        _same(_run(hf, lora_cli(hf, sft_data["padded"], *LAYOUTS[layout]), 2), want)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_folded_adapters_give_the_adapted_logits(moe_base, grouped):
    """``anyspeed generate --lora-load`` folds the adapters into the weights (so decoding runs
    no hook): the folded model's logits are the adapted one's, nothing of LoRA is left."""
    tokens = torch.randint(0, 700, (2, 16), generator=torch.Generator().manual_seed(3))
    out = lora_ranks.folded_logits(moe_base, TARGETS, tokens, grouped)
    assert (out["folded"] - out["adapted"]).abs().max() < 1e-4
    assert out["n"] == (2 * 2 + 2 * (1 if grouped else 2 * 4))  # qkv+proj; grouped or 4 experts
    assert not out["left"] and out["hooks"] == 0 and not out["view"]


MLA = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
       "linear_proj", "linear_fc1", "linear_fc2"]  # fmt: skip


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict:
    """A tiny DeepSeek-V3 (MLA with low-rank queries, a dense first layer, shared and routed
    experts) as an HF directory and a Megatron checkpoint."""
    from helpers.convert_ranks import tiny_hf_model

    d = tmp_path_factory.mktemp("deepseek")
    tiny_hf_model(d / "hf", "tiny-deepseek-v3", seed=2, vocab_size=768)
    for stand_in in (d / "hf").glob("tokenizer*"):  # the data is tokenized: no tokenizer needed
        stand_in.unlink()
    return {"hf": str(d / "hf"), "base": _to_megatron(str(d / "hf"), str(d / "base"))}


def test_mla_adapters_merge_into_transformers(deepseek, tmp_path, capsys):
    """LoRA on multi-latent attention's four projections and the dense, shared-expert and
    routed-expert MLPs of a DeepSeek-V3: the merged export in transformers gives the adapted
    logits. PEFT applies the attention adapters' export onto transformers' model with the same
    logits; an export also holding dense and expert MLPs warns (PEFT 0.21 maps every gate/up/
    down target onto the stacked experts)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(4))
    to_hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", deepseek["base"]]
    vocab = AutoModelForCausalLM.from_pretrained(deepseek["hf"]).config.vocab_size
    lora = str(tmp_path / "lora")
    logits = lora_ranks.adapter_checkpoint(deepseek["base"], lora, MLA, R, ALPHA, tokens)
    assert convert([*to_hf, "--save-dir", str(tmp_path / "merged"), "--lora-load", lora]) == 0
    want = logits[..., :vocab].float()
    assert (_hf_logits(str(tmp_path / "merged"), tokens) - want).abs().max() < 1e-4
    assert (_hf_logits(deepseek["hf"], tokens) - want).abs().max() > 1e-2
    capsys.readouterr()
    assert convert([*to_hf, "--save-dir", str(tmp_path / "mixed"), "--lora-load", lora,
                    "--save-lora-to-hf"]) == 0  # fmt: skip
    assert "PEFT 0.21 with transformers 5 maps every gate/up/down" in capsys.readouterr().err
    attn = str(tmp_path / "attn")
    logits = lora_ranks.adapter_checkpoint(deepseek["base"], attn, MLA[:5], R, ALPHA, tokens)
    peft = str(tmp_path / "peft")
    assert convert([*to_hf, "--save-dir", peft, "--lora-load", attn, "--save-lora-to-hf"]) == 0
    base = AutoModelForCausalLM.from_pretrained(deepseek["hf"], dtype=torch.float32)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, peft).eval()(input_ids=tokens).logits.float()
    assert (got - logits[..., :vocab].float()).abs().max() < 1e-4


def _down_projections_a(it_dir: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved ``lora_A`` of layer ``layer``'s query and KV down-projections."""
    from pathlib import Path

    from anyspeed.convert.dcp_io import DcpReader
    from anyspeed.convert.engine import materialize
    from anyspeed.convert.torch_dist import read_entry

    reader, attn = DcpReader(it_dir), f"decoder.layers.{layer}.self_attention."
    q, kv = (
        materialize(read_entry(reader, f"{attn}{m}.lora_A", (), Path(it_dir)))
        for m in ("linear_q_down_proj", "linear_kv_down_proj")
    )
    return q, kv


def test_mindspeed_linear_qkv_on_mla_is_one_fused_adapter(deepseek, tmp_path):
    """MindSpeed-LLM's DeepSeek-V3 LoRA targets (``linear_qkv linear_proj linear_fc1
    linear_fc2``): on MLA ``linear_qkv`` is one adapter of the query and KV down-projections
    that MindSpeed-LLM fuses, A shared, B split. The merged export in transformers gives the
    adapted logits, and both projections' saved A are one tensor."""
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(5))
    lora = str(tmp_path / "lora")
    logits = lora_ranks.adapter_checkpoint(deepseek["base"], lora, TARGETS, R, ALPHA, tokens)
    to_hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", deepseek["base"]]
    assert convert([*to_hf, "--save-dir", str(tmp_path / "merged"), "--lora-load", lora]) == 0
    got = _hf_logits(str(tmp_path / "merged"), tokens)
    assert (got - logits[..., : got.shape[-1]].float()).abs().max() < 1e-4
    q, kv = _down_projections_a(f"{lora}/iter_0000001", 0)
    assert torch.equal(q, kv)


@pytest.mark.slow
@pytest.mark.parametrize("targets", ["mla", "mindspeed"])
def test_mla_lora_at_tp2_sp_and_ep2(deepseek, sft_data, targets, tmp_path):
    """DeepSeek-V3 with LoRA on MLA's projections (named, or MindSpeed-LLM's fused
    ``linear_qkv``) and every MLP (dense, shared, routed): TP2+SP (the projections' adapters
    communicate as column layers', the KV down-projection's is whole) and EP2 equal one process;
    trained, the fused adapter's A is still one tensor."""
    hf = deepseek["hf"]

    def argv(*extra: str) -> list[str]:
        out = lora_cli(hf, sft_data["padded"], *extra)
        at = out.index("--lora-target-modules") + 1
        return out[:at] + (MLA if targets == "mla" else TARGETS) + out[at + len(TARGETS) :]

    want = _run(hf, argv("--save", str(tmp_path / "one"), "--save-interval", "3"), 1)
    assert want["loss"][-1] < want["loss"][0]
    for layout in ("tp2-sp", "ep2"):
        _same(_run(hf, argv(*LAYOUTS[layout]), 2), want)
    if targets == "mindspeed":
        q, kv = _down_projections_a(str(tmp_path / "one" / "iter_0000003"), 1)
        assert torch.equal(q, kv)
