"""``anyspeed posttrain --stage vlm`` on a Qwen2.5-VL (and Qwen2-VL) Hugging Face directory,
with mllm records of drawn images at two sizes and two 4-frame videos. The first loss equals
transformers' own loss of the same batch; loss and grad norm at TP2 + SP and DP2 (distributed
optimizer), PP2 (the tower on the first stage) and CP2 (ring and Ulysses; every image whole on
each rank) equal one process within 1e-5 over 3 steps; a frozen tower stays bit-identical; video
pixels follow the processor's layout; bad records are counted and named."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from anyspeed.demo import qwen_vl_data as q
from anyspeed.testing import run_distributed
from helpers import qwen_vl_ranks, sft_ranks

TOL = 1e-5
SEQ = 64


def _video(folder, name: str, rng) -> list[str]:
    """Four 16 x 16 frames of one shape moving right (16 x 16: the processor keeps the size)."""
    from PIL import Image

    frames = []
    for k in range(4):
        path = folder / "images" / f"{name}_{k}.png"
        im = Image.new("RGB", (16, 16), (10, 10, 10))
        im.paste((200, 40, 40), (2 + 2 * k, 5, 8 + 2 * k, 11))
        im.save(path)
        frames.append(f"images/{name}_{k}.png")
    return frames


def _material(d, kind: str) -> dict:
    hf = q.make_model(str(d / kind), kind)
    path = q.make_records(str(d), 14, 0, "train")
    records = json.loads(open(path, encoding="utf-8").read())
    for i in range(2):
        frames = _video(d, f"video{i}", None)
        records.append({"messages": [{"role": "user", "content": "<video>what is in the picture?"},
                                     {"role": "assistant", "content": "a red square"}],
                        "videos": [frames]})  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f)
    return {"dir": d, "data": path, "hf": hf, "kind": kind}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return _material(tmp_path_factory.mktemp("qwen_vl"), "qwen2_5_vl")


def _cli(demo, *extra: str, iters: int = 3) -> list[str]:
    return ["--stage", "vlm", "--load", demo["hf"], "--data-path", demo["data"],
            "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "1e-3", "--split", "100,0,0",
            "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def one(demo):
    save = ["--save", str(demo["dir"] / "one_ck"), "--save-interval", "3"]
    return run_distributed(sft_ranks.posttrain, 1, cli=_cli(demo, *save))[0]


def _hf_first_loss(demo) -> float:
    """transformers' loss of the first global batch: its own model on the same tokens and
    the processor's pixels, one sample at a time."""
    import transformers as T

    from anyspeed.data.qwen_vl_pixels import Pixels, processor_settings
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.stages.common.instruction_data import sample_order
    from anyspeed.stages.vlm import qwen_data
    from anyspeed.stages.vlm.qwen import QwenVLConfig

    cls = (T.Qwen2_5_VLForConditionalGeneration if demo["kind"] == "qwen2_5_vl"
           else T.Qwen2VLForConditionalGeneration)  # fmt: skip
    model = cls.from_pretrained(demo["hf"], attn_implementation="eager").eval()
    config = json.loads(open(f"{demo['hf']}/config.json").read())
    settings = processor_settings(demo["hf"], 2, 2, 2)
    vision = QwenVLConfig(config, settings, demo["hf"]).vision()
    tok = load_tokenizer(TokenizerSpec(name_or_path=demo["hf"]))
    data = qwen_data.read(demo["data"], str(demo["dir"]), tok, vision, SEQ, 1 << 30)
    pixels = Pixels(settings)
    total, count = 0.0, 0
    for i in sample_order((0, len(data)), 8 * 3, 1234)[:8]:
        s = data.samples[int(i)]
        batch = qwen_data.micro_batch(data, [int(i)], len(s.tokens) - 1, pixels, True)
        kw = {k: v for k, v in batch.items() if k not in ("tokens", "labels", "loss_mask")}
        ids = batch["tokens"]  # transformers takes the 3-D positions' token kinds separately
        kw["mm_token_type_ids"] = (ids == vision.image_token).int() + 2 * (
            ids == vision.video_token
        ).int()
        with torch.no_grad():
            logits = model(input_ids=ids, **kw).logits[0]
        lp = torch.log_softmax(logits.double(), -1)
        target, mask = batch["labels"][0], batch["loss_mask"][0].bool()
        total += float(-lp[torch.arange(len(target)), target][mask].sum())
        count += int(mask.sum())
    return total / count


def test_first_loss_equals_transformers(one, demo):
    assert one["loss"][0] == pytest.approx(_hf_first_loss(demo), abs=TOL)
    assert all(math.isfinite(x) for x in one["loss"]) and one["loss"][-1] < one["loss"][0]


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        pytest.param(["--use-distributed-optimizer"], marks=pytest.mark.slow),
        ["--pipeline-model-parallel-size", "2"],
        ["--context-parallel-size", "2"],
        pytest.param(
            ["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["tp2_sp", "dp2_distopt", "pp2", "cp2_ring", "cp2_ulysses"],
)
def test_loss_and_grad_norm_equal_one_process(layout, one, demo):
    cli = _cli(demo, *layout)  # argv: the adaptor's context-parallel attention
    two = run_distributed(sft_ranks.posttrain, 2, cli=cli, argv=cli)[-1]  # PP: the last stage
    assert two["loss"] == pytest.approx(one["loss"], rel=TOL)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=TOL)


def test_converted_checkpoint_trains_at_tp2_and_converts_back(one, demo):
    """The HF start converted (anyspeed convert) and trained at TP2 from its torch_dist files
    equals one process; both runs' final checkpoints convert to the same HF tensors."""
    from anyspeed.commands.convert import main as convert

    d = demo["dir"]
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                    demo["hf"], "--save-dir", str(d / "mg")]) == 0  # fmt: skip
    cli = _cli(demo, "--tensor-model-parallel-size", "2", "--save", str(d / "tp2_ck"),
               "--save-interval", "3")  # fmt: skip
    cli[cli.index(demo["hf"])] = str(d / "mg")
    tp2 = run_distributed(sft_ranks.posttrain, 2, cli=cli)[0]
    assert tp2["loss"] == pytest.approx(one["loss"], rel=TOL)
    assert tp2["grad_norm"] == pytest.approx(one["grad_norm"], rel=TOL)
    tensors = []
    for name in ("one_ck", "tp2_ck"):
        out = d / f"{name}_hf"
        assert convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                        str(d / name), "--save-dir", str(out)]) == 0  # fmt: skip
        from safetensors.torch import load_file

        tensors.append({k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()})
    assert sorted(tensors[0]) == sorted(tensors[1])
    for k, v in tensors[0].items():  # Adam turns 1e-7 gradient noise into up to ~1e-5 moves
        assert torch.allclose(v, tensors[1][k], atol=5e-5), k


@pytest.mark.slow
def test_qwen2_vl_first_loss_and_tp2(tmp_path):
    demo = _material(tmp_path, "qwen2_vl")
    one = run_distributed(sft_ranks.posttrain, 1, cli=_cli(demo))[0]
    assert one["loss"][0] == pytest.approx(_hf_first_loss(demo), abs=TOL)
    tp2 = run_distributed(
        sft_ranks.posttrain, 2, cli=_cli(demo, "--tensor-model-parallel-size", "2")
    )[0]
    assert tp2["loss"] == pytest.approx(one["loss"], rel=TOL)
    assert tp2["grad_norm"] == pytest.approx(one["grad_norm"], rel=TOL)


@pytest.mark.slow
def test_frozen_tower_stays_bit_identical(demo):
    """--freeze-ViT: after 3 steps the tower equals the HF tower bit for bit; the merger and
    the language model have moved."""
    from anyspeed.convert.hf_io import HFCheckpoint
    from anyspeed.convert.qwen_vl import current_name, model_to_megatron

    out = run_distributed(qwen_vl_ranks.vlm_tower, 1, cli=_cli(demo, "--freeze-ViT"))[0]
    ck = HFCheckpoint(demo["hf"])
    names = {current_name(n): n for n in ck.names}
    config = json.loads(open(f"{demo['hf']}/config.json").read())
    _, _, start = model_to_megatron(config, lambda n: ck.get(names[n]))
    tower = {k: v for k, v in out.items() if not k.startswith("merger")}
    assert tower and all(torch.equal(v, start[f"vision.{k}"]) for k, v in tower.items())
    merger = {k: v for k, v in out.items() if k.startswith("merger")}
    assert any(not torch.equal(v, start[f"vision.{k}"]) for k, v in merger.items())


def test_video_pixels_follow_the_processor_layout(tmp_path):
    """A 4-frame video's rows equal the processor's layout computed here by hand: frames
    normalised with CLIP's mean/std, grouped in pairs, patches in 2x2 merge-block order."""
    from PIL import Image

    from anyspeed.data.qwen_vl_pixels import Pixels
    from anyspeed.stages.vlm.data import NORMALISE

    (tmp_path / "images").mkdir()
    frames = [str(tmp_path / f) for f in _video(tmp_path, "v", None)]
    rows, grid = Pixels({"patch_size": 2, "merge_size": 2, "temporal_patch_size": 2,
                         "min_pixels": 16, "max_pixels": 256}).video(frames)  # fmt: skip
    assert grid.tolist() == [[2, 8, 8]]
    mean, std = (np.array(v, dtype=np.float32).reshape(3, 1, 1) for v in NORMALISE["clip"])
    x = np.stack(
        [
            (np.asarray(Image.open(f).convert("RGB"), np.float32).transpose(2, 0, 1) / 255 - mean)
            / std
            for f in frames
        ]
    )  # fmt: skip  [4, C, 16, 16]
    x = x.reshape(2, 2, 3, 4, 2, 2, 4, 2, 2).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    assert torch.allclose(rows, torch.from_numpy(x.reshape(128, 24)), atol=1e-6)


def test_bad_records_are_counted_and_named(demo, tmp_path, capsys):
    """A missing image, an image that cannot be decoded and more image tags than images are
    skipped and counted, naming the file and the record; a record without turns stops before
    start in one line."""
    import shutil

    from anyspeed.errors import UsageError
    from anyspeed.stages.prepare import prepare

    good = json.loads(open(demo["data"], encoding="utf-8").read())[:8]
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png at all")
    for rec in good:
        shutil.copy(demo["dir"] / rec["images"][0], tmp_path / rec["images"][0])
    first = good[0]
    two_tags = [{"role": "user", "content": "<image><image>what?"}, first["messages"][1]]
    from PIL import Image

    Image.new("1", (3000, 3000)).save(tmp_path / "images" / "bomb.png")  # 9 Mpixels, ~1 KB
    literal = [{"role": "user", "content": "<image><|image_pad|> what?"}, first["messages"][1]]
    bad = [dict(first, images=["images/nowhere.png"]), dict(first, images=["images/broken.png"]),
           dict(first, messages=two_tags), dict(first, images=["images/bomb.png"]),
           dict(first, messages=literal)]  # fmt: skip
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(good + bad), encoding="utf-8")
    cli = _cli(demo, "--max-image-pixels", "4000000")
    cli[cli.index(demo["data"])] = str(path)
    run, _ = prepare(cli, where="launcher", command="posttrain")
    assert len(run.data) == 8
    err = capsys.readouterr().err
    needles = ("missing image; first: record 8", "nowhere.png",
               "undecodable image; first: record 9", "<image> tags; first: record 10",
               "image too large; first: record 11", "bomb.png", "9000000 pixels",
               "image pads; first: record 12")  # fmt: skip
    for needle in needles:
        assert needle in err, err
    path.write_text(json.dumps(good[:1] + [{"image": "x.png"}]), encoding="utf-8")
    with pytest.raises(UsageError, match="record 1: not a conversation record") as exc:
        prepare(cli, where="launcher", command="posttrain")
    assert "\n" not in str(exc.value)


LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "--lora-r", "4",
        "--lora-alpha", "8"]  # fmt: skip


def test_lora_on_the_language_model(one, demo):
    """LoRA adapters on the language model: the first loss is the base model's (B starts at
    zero), TP2 equals one process over 3 steps, and the tower (frozen with the base) stays
    bit-identical."""
    from anyspeed.convert.hf_io import HFCheckpoint
    from anyspeed.convert.qwen_vl import current_name, model_to_megatron

    tp1 = run_distributed(sft_ranks.posttrain, 1, cli=_cli(demo, *LORA))[0]
    cli = _cli(demo, *LORA, "--tensor-model-parallel-size", "2")
    tp2 = run_distributed(sft_ranks.posttrain, 2, cli=cli)[0]
    assert tp1["loss"][0] == pytest.approx(one["loss"][0], rel=TOL)
    assert tp1["loss"][1:] != pytest.approx(one["loss"][1:], rel=1e-3)  # only adapters moved
    assert tp2["loss"] == pytest.approx(tp1["loss"], rel=TOL)
    assert tp2["grad_norm"] == pytest.approx(tp1["grad_norm"], rel=TOL)
    tower = run_distributed(qwen_vl_ranks.vlm_tower, 1, cli=_cli(demo, *LORA, iters=1))[0]
    ck = HFCheckpoint(demo["hf"])
    names = {current_name(n): n for n in ck.names}
    config = json.loads(open(f"{demo['hf']}/config.json").read())
    _, _, start = model_to_megatron(config, lambda n: ck.get(names[n]))
    assert all(torch.equal(v, start[f"vision.{k}"]) for k, v in tower.items())


def test_lora_adapters_merge_into_an_hf_export(demo, tmp_path):
    """A LoRA run's adapters merged by ``anyspeed convert --lora-load`` into the converted base:
    transformers' logits of the export equal the trained model's (adapters on) within 1e-4."""
    import transformers as T

    from anyspeed.commands.convert import main as convert
    from anyspeed.convert.qwen_vl_api import _verify_inputs

    config = json.loads(open(f"{demo['hf']}/config.json").read())
    inputs = _verify_inputs(config)
    cli = _cli(demo, *LORA, "--save", str(tmp_path / "lora"), "--save-interval", "3")
    want = run_distributed(qwen_vl_ranks.lora_logits, 1, cli=cli, inputs=dict(inputs))[0]
    base, out = tmp_path / "base", tmp_path / "merged"
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                    demo["hf"], "--save-dir", str(base)]) == 0  # fmt: skip
    assert convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                    str(base), "--lora-load", str(tmp_path / "lora"), "--save-dir",
                    str(out)]) == 0  # fmt: skip
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(out, attn_implementation="eager")
    ids = inputs["input_ids"]
    types = (ids == config["image_token_id"]).int() + 2 * (ids == config["video_token_id"]).int()
    with torch.no_grad():
        got = hf.eval()(mm_token_type_ids=types, **inputs).logits
    base_logits = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(demo["hf"]).eval()
    with torch.no_grad():
        before = base_logits(mm_token_type_ids=types, **inputs).logits
    assert (want["logits"] - before).abs().max() > 1e-3  # the adapters moved the model
    assert torch.allclose(want["logits"][..., : got.shape[-1]], got, atol=1e-4)


def test_text_stages_refuse_a_qwen_vl_directory_in_one_line(demo):
    """A Qwen-VL directory given to a text stage names the commands that take it."""
    from anyspeed.errors import UsageError
    from anyspeed.stages.prepare import prepare

    cli = ["--stage", "sft", "--load", demo["hf"], "--data-path", "x", "--seq-length", "64",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
           "--lr", "1e-5"]  # fmt: skip
    with pytest.raises(UsageError, match="vision-language model: train it with") as exc:
        prepare(cli, where="launcher", command="posttrain")
    assert "\n" not in str(exc.value) and "--stage vlm" in str(exc.value)


def _grpo_cli(demo, *extra: str) -> list[str]:
    return ["--stage", "vlm_grpo", "--load", demo["hf"], "--data-path", demo["data"],
            "--seq-length", str(SEQ), "--micro-batch-size", "4", "--global-batch-size", "16",
            "--n-samples-per-prompt", "4", "--max-response-length", "8", "--train-iters", "2",
            "--lr", "1e-3", "--log-interval", "100", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--make-vocab-size-divisible-by", "1",
            "--verifier-function", "helpers.user_rewards:letter_a", *extra]  # fmt: skip


def test_vlm_grpo_rollouts_and_update_equal_at_every_layout(demo):
    """GRPO from image prompts (rollouts sampled per sample from seeded generators): loss and
    grad norm of 2 steps at TP2 and DP2 equal one process; the gradient is not zero."""
    one = run_distributed(sft_ranks.posttrain, 1, cli=_grpo_cli(demo))[0]
    assert one["grad_norm"][0] > 1e-3
    for extra in (["--tensor-model-parallel-size", "2"], []):
        two = run_distributed(sft_ranks.posttrain, 2, cli=_grpo_cli(demo, *extra))[0]
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)


def test_vlm_grpo_bad_flags_are_one_line(demo):
    from anyspeed.errors import UsageError
    from anyspeed.stages.prepare import prepare

    for extra, needle in ((["--n-samples-per-prompt", "1"], "at least 2"),
                          (["--n-samples-per-prompt", "3"], "dividing --global-batch-size"),
                          (["--temperature", "0"], "--temperature must be > 0")):  # fmt: skip
        with pytest.raises(UsageError, match=needle) as exc:
            prepare(_grpo_cli(demo, *extra), where="launcher", command="posttrain")
        assert "\n" not in str(exc.value)
