"""``anyspeed posttrain --stage vlm``: a LLaVA model trained from a Hugging Face directory on
drawn images and their captions. The first loss equals transformers' own loss of the same
batch; loss and grad norm at TP2, PP2 and DP2 (distributed optimizer) equal one process within 1e-5
over 3 steps; a frozen tower stays bit-identical; bad records are counted, not fatal."""

from __future__ import annotations

import json
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
    pp2 = run_distributed(sft_ranks.posttrain, 2, cli=_cli(demo, "--pipeline-model-parallel-size",
                                                              "2"))[-1]  # fmt: skip
    # the same start converted first (anyspeed convert), trained at TP2 from the torch_dist files
    from anyspeed.commands.convert import main as convert

    mg = str(demo["dir"] / "mg")
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                    demo["hf"], "--save-dir", mg]) == 0  # fmt: skip
    cli = _cli(demo, "--tensor-model-parallel-size", "2", "--tokenizer-type", "PretrainedFromHF",
               "--tokenizer-name-or-path", demo["hf"])  # fmt: skip
    cli[cli.index(demo["hf"])] = mg
    converted = run_distributed(sft_ranks.posttrain, 2, cli=cli)[0]
    return {"one": one, "tp2": tp2, "dp2": dp2, "pp2": pp2, "converted_tp2": converted}


def _hf_first_loss(demo) -> float:
    """transformers' LLaVA loss of the first global batch (its own forward and processor-free
    inputs: the same pixels, the image token repeated as its processor expands it)."""
    import transformers as T

    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.stages.common.instruction_data import sample_order
    from anyspeed.stages.vlm import data as vlm_data

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


@pytest.mark.parametrize("layout", ["tp2", "dp2", "pp2", "converted_tp2"])
def test_loss_and_grad_norm_equal_one_process(layout, runs):
    assert runs[layout]["loss"] == pytest.approx(runs["one"]["loss"], rel=TOL)
    assert runs[layout]["grad_norm"] == pytest.approx(runs["one"]["grad_norm"], rel=TOL)
    assert all(math.isfinite(x) for x in runs["one"]["loss"])


def test_frozen_tower_stays_bit_identical(demo):
    """--freeze-ViT: after 3 steps the tower equals the HF tower bit for bit; the projector
    has moved."""
    from anyspeed.convert import llava as conv
    from anyspeed.convert.hf_io import HFCheckpoint, read_config
    from anyspeed.models.vision import llava_from_hf
    from helpers import llava_ranks

    out = run_distributed(llava_ranks.vlm_weights, 1, cli=_cli(demo, "--freeze-ViT"))[0]
    ck = HFCheckpoint(demo["hf"])
    layout = conv.layout_of(ck.names)
    start = conv.to_megatron(llava_from_hf(read_config(demo["hf"])),
                             lambda n: ck.get(conv.hf_name(n, layout)), 64)  # fmt: skip
    for k, v in out["vision"].items():
        assert torch.equal(v, start[f"vision_model.{k}"]), k
    moved = [k for k, v in out["projector"].items()
             if not torch.equal(v, start[f"vision_projection.{k}"])]  # fmt: skip
    assert moved


def test_bad_records_are_counted_and_a_bad_line_is_one_error(demo, tmp_path, capsys):
    """A missing image, an image that cannot be decoded and more image tags than images are
    skipped and counted (naming the first); a line that is not a record stops before start."""
    from anyspeed.errors import UsageError
    from anyspeed.stages.prepare import prepare

    good = open(demo["data"], encoding="utf-8").read().splitlines()[:8]
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png at all")
    first = json.loads(good[0])
    import shutil

    for line in good:
        rec = json.loads(line)
        shutil.copy(demo["dir"] / rec["image"], tmp_path / rec["image"])
    bad = [dict(first, image="images/nowhere.png"), dict(first, image="images/broken.png"),
           dict(first, conversations=[{"from": "human", "value": "<image> <image> what?"},
                                      {"from": "gpt", "value": "a red circle"}])]  # fmt: skip
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(good + [json.dumps(b) for b in bad]) + "\n", encoding="utf-8")
    cli = _cli(demo)
    cli[cli.index(demo["data"])] = str(path)
    run, _ = prepare(cli, where="launcher", command="posttrain")
    assert len(run.data) == 8
    err = capsys.readouterr().err
    for needle in ("missing image; first: line 9", "undecodable image; first: line 10",
                   "image tags; first: line 11"):  # fmt: skip
        assert needle in err
    path.write_text(good[0] + "\n{not json\n", encoding="utf-8")
    with pytest.raises(UsageError, match="line 2: not a LLaVA record") as exc:
        prepare(cli, where="launcher", command="posttrain")
    assert "\n" not in str(exc.value)


def test_unsupported_layouts_and_lora_are_one_line_errors(demo):
    from anyspeed.errors import UsageError
    from anyspeed.stages.prepare import prepare

    for extra, needle in ((["--lora-r", "8"], "LoRA is not supported"),
                          (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                           "sequence-parallel")):  # fmt: skip
        with pytest.raises(UsageError, match=needle) as exc:
            prepare(_cli(demo, *extra, "--nproc-per-node", "2"), where="launcher",
                    command="posttrain")  # fmt: skip
        assert "\n" not in str(exc.value)
    # the demo model has 2 layers, too few for interleaving from the command line
    from anyspeed.convert.hf_io import read_config
    from anyspeed.layout import Layout
    from anyspeed.models.multimodal import check_layout
    from anyspeed.models.vision import llava_from_hf

    with pytest.raises(ValueError, match="virtual-pipeline"):
        check_layout(llava_from_hf(read_config(demo["hf"])), Layout(pp=2, vpp=2))
