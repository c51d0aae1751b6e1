"""SFT loss: response tokens only, one global token mean, equal to transformers' own loss of
the same HF model at every layout; a packed batch's loss equals its samples run one by one.

The global batch is the whole training split, so its loss does not depend on the sample
order; the reference is transformers on each sample alone (HF shifts the labels itself)."""

from __future__ import annotations

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import read_back

TOL = 1e-5


def hf_token_mean(hf_dir: str, prefix: str, rows: list[int] | None = None) -> float:
    """transformers: summed response-token cross entropy of every sample (or of ``rows``), run
    one at a time, over the number of response tokens (the -100 prompt labels ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = read_back(f"{prefix}_packed_input_ids_document")
    labels = read_back(f"{prefix}_packed_labels_document")
    if rows is not None:
        ids, labels = [ids[r] for r in rows], [labels[r] for r in rows]
    total, count = 0.0, 0
    with torch.no_grad():
        for i, lab in zip(ids, labels, strict=True):
            x, y = torch.tensor([i]), torch.tensor([lab])
            n = int((y[:, 1:] != -100).sum())
            total += float(model(input_ids=x, labels=y).loss) * n  # HF: mean over its n tokens
            count += n
    return total / count


def cli(hf: str, prefix: str, *extra: str, seq: int = 96, gbs: int = 8) -> list[str]:
    return [
        "--stage",
        "sft",
        "--is-instruction-dataset",
        "--load",
        hf,
        "--finetune",
        "--data-path",
        prefix,
        "--seq-length",
        str(seq),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        "1",
        "--lr",
        "1e-3",
        "--split",
        "100,0,0",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
        "--no-progress-bar",
        *extra,
    ]


@pytest.mark.slow
def test_padded_loss_equals_transformers(sft_data, tiny_qwen):
    """Padded to --seq-length, and to each micro-batch's longest (--variable-seq-lengths)."""
    fixed = cli(tiny_qwen, sft_data["padded"])
    variable = cli(tiny_qwen, sft_data["padded"], "--variable-seq-lengths")
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=fixed, clis=[fixed, variable],
                           timeout=300)[0]  # fmt: skip
    want = hf_token_mean(tiny_qwen, sft_data["padded"])
    assert [h["loss"][0] for h in runs] == pytest.approx([want, want], rel=TOL)


@pytest.mark.slow
def test_packed_loss_equals_samples_one_by_one(sft_data, tiny_qwen):
    rows = len(read_back(f"{sft_data['packed']}_packed_input_ids_document"))
    assert rows < 8  # several samples share a row
    argv = cli(
        tiny_qwen, sft_data["packed"], "--neat-pack", "--reset-attention-mask", seq=192, gbs=rows
    )
    hist = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    assert hist["loss"][0] == pytest.approx(hf_token_mean(tiny_qwen, sft_data["padded"]), rel=TOL)


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
    "dp2": [],
}


@pytest.fixture(scope="module")
def layout_losses(sft_data, tiny_qwen) -> dict[str, float]:
    """First-step loss at each two-rank layout, all in one process group."""
    argvs = [cli(tiny_qwen, sft_data["padded"], *flags) for flags in LAYOUTS.values()]
    runs = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    return {name: runs[0][i]["loss"][0] for i, name in enumerate(LAYOUTS)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padded_loss_at_every_layout(layout, layout_losses, sft_data, tiny_qwen):
    want = hf_token_mean(tiny_qwen, sft_data["padded"])
    assert layout_losses[layout] == pytest.approx(want, rel=TOL)


def test_dualpipev_equals_transformers(sft_data, tied_qwen4):
    """SFT under DualPipeV at PP2 (tied embedding and output layer both on rank 0, the loss
    masked to the responses there): transformers' token mean."""
    dualpipev = ["--pipeline-model-parallel-size", "2", "--schedules-method", "dualpipev"]
    argv = cli(tied_qwen4, sft_data["padded"], *dualpipev)
    hist = run_distributed(sft_ranks.posttrain, 2, argv=argv, cli=argv, timeout=300)[0]
    want = hf_token_mean(tied_qwen4, sft_data["padded"])
    assert hist["loss"][0] == pytest.approx(want, rel=TOL)


def test_tokens_per_second_counts_the_tokens_a_step_processed(sft_data, tiny_qwen, tmp_path):
    """Under --variable-seq-lengths a micro-batch is padded to its longest sample, not to
    --seq-length: the logged rate counts those tokens (it counted every sample at --seq-length
    and inflated MFU), so a step's tokens are below 8 x 96 and at least 8 x the shortest."""
    import json

    metrics = str(tmp_path / "m.jsonl")
    argv = cli(tiny_qwen, sft_data["padded"], "--variable-seq-lengths", "--metrics-file", metrics)
    run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)
    lengths = [len(r) for r in read_back(f"{sft_data['padded']}_packed_input_ids_document")]
    for row in map(json.loads, open(metrics)):
        tokens = row["tokens_per_s"] * row["ms_per_iter"] / 1000
        assert 8 * min(lengths) * 0.99 <= tokens < 0.9 * 8 * 96, (tokens, lengths)


@pytest.mark.slow  # a one-process and a two-process run; the V's SFT path is fast-tested above
def test_dualpipev_lora_equals_one_process(sft_data, tied_qwen4):
    """LoRA on every linear under DualPipeV with deferred weight gradients (the frozen bases
    take Megatron's frozen-weight path, the adapters the V's): 3 steps equal one process."""
    lora = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
            "--lora-r", "4"]  # fmt: skip
    base = cli(tied_qwen4, sft_data["padded"], *lora)
    base[base.index("--train-iters") + 1] = "3"
    one = run_distributed(sft_ranks.posttrain, 1, argv=base, cli=base, timeout=300)[0]
    v = base + ["--pipeline-model-parallel-size", "2", "--schedules-method", "dualpipev",
                "--dualpipev-dw-detach"]  # fmt: skip
    two = run_distributed(sft_ranks.posttrain, 2, argv=v, cli=v, timeout=300)[0]
    assert two["loss"] == pytest.approx(one["loss"], rel=TOL)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=TOL)
    assert one["loss"][-1] < one["loss"][0]


def test_no_shuffle_reads_file_order_and_any_pad_multiple(sft_data, tiny_qwen):
    """MindSpeed-LLM's ``--no-shuffle``: the first global batch is the file's first samples
    (its loss is transformers' over samples 0 and 1; the seeded shuffle takes others), padded
    to the pair's longest with ``--pad-to-multiple-of 1`` (padding is invisible to the loss)."""
    prefix = sft_data["padded"]
    extra = ("--no-pad-to-seq-lengths", "--pad-to-multiple-of", "1")
    clis = [cli(tiny_qwen, prefix, *extra, "--no-shuffle", gbs=2), cli(tiny_qwen, prefix, gbs=2)]
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=clis[0], clis=clis, timeout=300)[0]
    want = hf_token_mean(tiny_qwen, prefix, rows=[0, 1])
    assert runs[0]["loss"][0] == pytest.approx(want, rel=TOL)
    assert runs[1]["loss"][0] != pytest.approx(want, rel=1e-3)
