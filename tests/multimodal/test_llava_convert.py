"""``anyspeed convert`` of LLaVA models (``LlavaForConditionalGeneration`` <-> a torch_dist
``LLaVAModel`` checkpoint): back bit-identical (CLIP and SigLIP, in the layout transformers
saves and in the published llava-hf layout), ``--verify`` against transformers' logits, and
flags that do not apply refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from anyspeed.commands.convert import main as convert
from helpers import llava


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _round_trip(tmp_path, hf_dir, capsys) -> dict[str, torch.Tensor]:
    mg, back = tmp_path / "mg", tmp_path / "back"
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                    str(hf_dir), "--save-dir", str(mg), "--verify"]) == 0  # fmt: skip
    assert convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg),
                    "--save-dir", str(back), "--verify"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("verify max-abs logits difference") == 2
    assert json.loads((back / "config.json").read_text())["model_type"] == "llava"
    return _tensors(back)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_round_trip_is_bit_identical(kind, tmp_path, capsys):
    hf_dir = llava.save(llava.hf_model(kind), tmp_path / "hf")
    back = _round_trip(tmp_path, hf_dir, capsys)
    ref = _tensors(hf_dir)
    assert set(back) == set(ref)
    assert all(torch.equal(back[k], ref[k]) for k in ref)


def test_published_layout_is_read_and_written_back(tmp_path, capsys):
    """The llava-hf checkpoints' names (``vision_tower.vision_model.*``) convert and come back
    under the same names."""
    hf_dir = llava.save(llava.hf_model("clip"), tmp_path / "hf")
    ref = _tensors(hf_dir)
    hub = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in ref.items()}
    for f in hf_dir.glob("*.safetensors*"):
        f.unlink()
    save_file(hub, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    mg, back = tmp_path / "mg", tmp_path / "back"
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                    str(hf_dir), "--save-dir", str(mg)]) == 0  # fmt: skip
    assert convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg),
                    "--save-dir", str(back)]) == 0  # fmt: skip
    out = _tensors(back)
    assert set(out) == set(hub) and all(torch.equal(out[k], hub[k]) for k in hub)


def test_flags_that_do_not_apply_are_one_line_errors(tmp_path, capsys):
    hf_dir = llava.save(llava.hf_model("clip"), tmp_path / "hf")
    capsys.readouterr()  # transformers' "Writing model shards" bar of the save above
    cases = (
        (["--ckpt-format", "legacy"], "torch_dist only"),
        (["--target-pipeline-parallel-size", "2"], "not supported for vision-language models"),
    )
    for extra, needle in cases:
        rc = convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                      str(hf_dir), "--save-dir", str(tmp_path / "mg"), *extra])  # fmt: skip
        lines = capsys.readouterr().err.strip().splitlines()
        err = "\n".join(x for x in lines if not x.startswith("anyspeed: "))  # not the notice
        assert rc == 1 and needle in err and "\n" not in err
        assert not (tmp_path / "mg").exists()
