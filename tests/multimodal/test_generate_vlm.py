"""Greedy generation with a LLaVA model: the KV cache (Megatron's static inference context,
batch 3) equals recomputing the sequence, which equals transformers' ``generate``; ``anyspeed
generate --image`` from an HF directory prints transformers' greedy captions; a bad image is
one line."""

from __future__ import annotations

import pytest
import torch

from anyspeed.commands.generate import main as generate_main
from anyspeed.convert import llava as conv
from anyspeed.convert.megatron_io import megatron_session
from anyspeed.inference.vlm import greedy
from anyspeed.models import gpt, multimodal
from anyspeed.models.vision import llava_from_hf
from helpers import llava
from helpers.inprocess import clean_after


def _hf_greedy(hf, ids: torch.Tensor, images: torch.Tensor, n: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          pixel_values=images, max_new_tokens=n, do_sample=False)  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def test_kv_cache_equals_recompute_equals_transformers_at_batch_3():
    hf = llava.hf_model("clip")
    cfg = llava_from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    state = conv.to_megatron(cfg, lambda n: sd[n], llava.VOCAB)
    images, hf_ids, mg_ids = llava.inputs(cfg.image_seq_len, batch=3)
    with megatron_session():
        model = multimodal.build_llava(cfg, gpt.transformer_config(cfg.language)).eval()
        conv.load_into(model, state, 1, 0)
        cached = greedy(model, images, mg_ids[0].tolist(), 8, llava.VOCAB, use_kv_cache=True)
        plain = greedy(model, images, mg_ids[0].tolist(), 8, llava.VOCAB, use_kv_cache=False)
    ref = _hf_greedy(hf, hf_ids[:1].expand(3, -1), images, 8)
    assert cached == plain == ref


def test_generate_image_command_prints_transformers_captions(tmp_path, capsys):
    import transformers as T

    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.demo import mm_data
    from anyspeed.stages.vlm.data import load_image, render

    hf_dir = mm_data.make_model(str(tmp_path / "hf"))
    mm_data.make_records(str(tmp_path), 2, 3, "pics")
    files = [str(tmp_path / "images" / f"pics_0000{i}.png") for i in range(2)]
    assert generate_main(["--load", hf_dir, "--image", files[0], "--image", files[1],
                          "--max-new-tokens", "6"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    hf = T.LlavaForConditionalGeneration.from_pretrained(hf_dir).eval()
    tok = load_tokenizer(TokenizerSpec(name_or_path=hf_dir))
    turn = {"conversations": [{"from": "human", "value": "<image>\nwhat is in the picture?"}]}
    prompt = render(turn, tok, mm_data.IMAGE_TOKEN)[0] + tok.encode(["ASSISTANT: "], False)[0]
    expanded = []
    for t in prompt:
        expanded += [t] * (16 if t == mm_data.IMAGE_TOKEN else 1)
    images = torch.stack([load_image(f, 32, "clip") for f in files])
    ref = _hf_greedy(hf, torch.tensor([expanded] * 2), images, 6)
    import tokenizers

    dec = tokenizers.Tokenizer.from_file(f"{hf_dir}/tokenizer.json")
    for f, row in zip(files, ref, strict=True):
        text = dec.decode([t for t in row if t != tok.eod_id][: row.index(tok.eod_id)]
                          if tok.eod_id in row else row)  # fmt: skip
        assert f"image: {f}\n{text}\n" in out


def test_bad_image_is_one_line(tmp_path, capsys):
    hf_dir = llava.save(llava.hf_model("clip"), tmp_path / "hf")
    (tmp_path / "bad.png").write_bytes(b"nope")
    (hf_dir / "tokenizer.json").write_text("{}")
    from PIL import Image

    Image.new("1", (5000, 4000)).save(tmp_path / "huge.png")  # 20M pixels in a few KB
    capsys.readouterr()  # transformers' progress bar of the save above
    for f, needle in ((tmp_path / "bad.png", "cannot be decoded"),
                      (tmp_path / "none.png", "no such file"),
                      (tmp_path / "huge.png", "is 5000 x 4000 = 20000000 pixels, over "
                                              "--max-image-pixels 16777216")):  # fmt: skip
        assert generate_main(["--load", str(hf_dir), "--image", str(f)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err


def test_images_over_the_pixel_limit_are_skipped_by_the_vlm_reader(tmp_path):
    """The ``vlm`` stage's reader counts an image over ``--max-image-pixels`` under its own
    reason, reading only its header (issue 43, item 7)."""
    import json

    from PIL import Image

    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.demo import mm_data
    from anyspeed.stages.vlm.data import read

    hf_dir = mm_data.make_model(str(tmp_path / "hf"))
    path = mm_data.make_records(str(tmp_path), 2, 0, "pics")
    Image.new("1", (300, 300)).save(tmp_path / "images" / "pics_00001.png")
    tok = load_tokenizer(TokenizerSpec(name_or_path=hf_dir))
    data = read(path, str(tmp_path), tok, mm_data.IMAGE_TOKEN, 64, max_pixels=200 * 200)
    assert len(data.samples) == 1 and list(data.skipped) == ["image too large"], data.skipped
    assert "300 x 300 = 90000 pixels" in data.skipped["image too large"][0]
    assert json.loads(open(path).readline())["image"].endswith("00000.png")


def _captions(out: str) -> list[str]:
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("image: "))
    return [line for line in lines[first:] if line.strip()]


def test_generate_image_at_pp2_is_one_line(tmp_path, capfd):
    """The fast twin of the TP2 test below: PP 2 with ``--image`` is refused in one line."""
    from anyspeed.demo import mm_data

    hf_dir = mm_data.make_model(str(tmp_path / "hf"), seed=3)
    mm_data.make_records(str(tmp_path), 1, 3, "pics")
    image = str(tmp_path / "images" / "pics_00000.png")
    argv = ["--load", hf_dir, "--image", image, "--pipeline-model-parallel-size", "2"]
    assert generate_main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert "--pipeline-model-parallel-size" in err[-1] and len(err) == 1


@pytest.mark.slow  # two ranks under torchrun (~35 s); the PP2 refusal has a fast twin above
def test_generate_image_at_tp2_equals_tp1_and_refuses_what_does_not_apply(tmp_path, capfd):
    """The same runner as every model: ``--image`` at TP2 (two ranks under torchrun) prints
    TP1's captions token for token; a text-only model with ``--image``, and PP 2, are one
    line each."""
    from anyspeed.demo import mm_data

    # seed 3: a random model whose greedy answers hold words of the tokenizer (others pick rows
    # past its 24 words, which decode to nothing) and differ between the two images
    hf_dir = mm_data.make_model(str(tmp_path / "hf"), seed=3)
    mm_data.make_records(str(tmp_path), 2, 3, "pics")
    files = [str(tmp_path / "images" / f"pics_0000{i}.png") for i in range(2)]
    base = ["--load", hf_dir, "--image", files[0], "--image", files[1], "--max-new-tokens", "6"]
    with clean_after():  # the one-process run leaves its launcher variables set
        assert generate_main(base) == 0
    one = _captions(capfd.readouterr().out)
    assert generate_main([*base, "--tensor-model-parallel-size", "2"]) == 0
    two = _captions(capfd.readouterr().out)
    assert len(one) == 4 and one[1] != one[3] and one == two, (one, two)
    assert generate_main([*base, "--pipeline-model-parallel-size", "2"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert "--pipeline-model-parallel-size" in err[-1] and len(err) == 1
