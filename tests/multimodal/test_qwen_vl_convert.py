"""``anyspeed convert`` for Qwen2-VL / Qwen2.5-VL: HF -> Megatron -> HF is byte-identical for
both versions and from either weight-name spelling, ``--verify`` compares logits with
transformers on an image and a video, and a checkpoint trained at TP2 converts back to an HF
model whose logits equal the Megatron model's."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from anyspeed.commands.convert import main as convert
from anyspeed.demo import qwen_vl_data as q


def _tensors(d) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _new_spelling(src, dst) -> None:
    """A checkpoint in transformers 5's module names (``model.visual.*``,
    ``model.language_model.*``); ``save_pretrained`` writes the Hub's ``visual.*``/``model.*``."""
    import shutil

    from anyspeed.convert.qwen_vl import current_name

    shutil.copytree(src, dst)
    tensors = _tensors(dst)
    assert any(k.startswith("visual.") for k in tensors)  # what transformers wrote
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    renamed = {current_name(k): v for k, v in tensors.items()}
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kind,spelling", [("qwen2_5_vl", "new"), ("qwen2_vl", "saved")])
def test_round_trip_is_byte_identical_and_verifies(kind, spelling, tmp_path, capsys):
    hf = tmp_path / "hf"
    q.make_model(str(hf), kind)
    if spelling == "new":
        _new_spelling(hf, tmp_path / "new")
        hf = tmp_path / "new"
    mg, back = tmp_path / "mg", tmp_path / "back"
    common = ["--verify", "--verify-tolerance", "1e-5"]
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
                    "--save-dir", str(mg), *common]) == 0  # fmt: skip
    assert convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg),
                    "--save-dir", str(back), *common]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("verify max-abs logits difference") == 2
    want, got = _tensors(hf), _tensors(back)
    assert sorted(want) == sorted(got)
    for k, v in want.items():
        assert v.dtype == got[k].dtype and v.shape == got[k].shape and v.equal(got[k]), k
    assert (back / "tokenizer.json").is_file() and (back / "preprocessor_config.json").is_file()
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["model_type"] == kind


def test_bad_verify_is_one_line(tmp_path, capsys):
    """A Megatron checkpoint verified against another model's HF directory fails in one line."""
    a, b = tmp_path / "a", tmp_path / "b"
    q.make_model(str(a), "qwen2_5_vl", seed=0)
    q.make_model(str(b), "qwen2_5_vl", seed=1)
    mg = tmp_path / "mg"
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(a),
                    "--save-dir", str(mg)]) == 0  # fmt: skip
    from anyspeed.convert import ConvertError
    from anyspeed.convert.qwen_vl_api import verify

    with pytest.raises(ConvertError, match="--verify: logits differ") as exc:
        verify(b, mg)
    assert "\n" not in str(exc.value)
