"""The published Qwen3.5 checkpoints are vision-language models
(``Qwen3_5ForConditionalGeneration``: the text model under ``model.language_model.``, a vision
tower under ``model.visual.``, MTP layers under ``mtp.``): ``convert`` and ``--load`` read their
text model. A tiny random one (with a stand-in MTP tensor, as the released files carry)
converts to logits within 1e-4 of the vision-language model's own on text, and back to a
``Qwen3_5ForCausalLM`` directory whose tensors are the text model's bit for bit."""

from __future__ import annotations

import json

import torch
from test_convert import _check, _load_hf_tensors

from anyspeed.models import get_preset
from anyspeed.models.hf import hf_config
from helpers.family_convert import converted

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(19))
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip


def _tiny_vlm(directory, seed: int = 9):
    """A random Qwen3_5ForConditionalGeneration of tiny-qwen3.5's text model (multimodal RoPE
    sections as the released configs write them) plus one ``mtp.`` tensor."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = hf_config(get_preset("tiny-qwen3.5"))
    text.pop("model_type")
    text["rope_parameters"] = dict(rope_type="default", rope_theta=text.pop("rope_theta"),
                                   partial_rotary_factor=text.pop("partial_rotary_factor"),
                                   mrope_section=[2, 1, 1], mrope_interleaved=True)  # fmt: skip
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=VISION)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.05))
    model.save_pretrained(str(directory))
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, str(path), metadata={"format": "pt"})
    (directory / "tokenizer.json").write_text('{"stand-in": "tokenizer"}\n')
    return model


def test_text_model_of_the_vlm_converts_and_back(tmp_path, monkeypatch):
    from helpers import convert_ranks

    monkeypatch.setattr(convert_ranks, "tiny_hf_model", lambda d, *a, **k: _tiny_vlm(d))
    case, res = converted(tmp_path, "tiny-qwen3.5", TOKENS, seed=9)
    ref = _load_hf_tensors(tmp_path / "hf")
    left = [k for k in ref if k.startswith(("model.visual.", "mtp."))]
    assert "mtp.fc.weight" in left and len(left) == len(ref) - 1 - sum(
        k.startswith("model.language_model.") for k in ref
    )
    assert f"is read as Qwen3_5ForCausalLM; {len(left)} tensors of the" in res["stdout"]
    vlm = _tiny_vlm(tmp_path / "again")
    with torch.no_grad():
        want = vlm(input_ids=TOKENS).logits
    _check(want, res["dist"])
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["Qwen3_5ForCausalLM"]
    got = _load_hf_tensors(tmp_path / "back")
    text = {"model." + k[len("model.language_model."):]: v for k, v in ref.items()
            if k.startswith("model.language_model.")}  # fmt: skip
    text["lm_head.weight"] = ref["lm_head.weight"]
    assert set(got) == set(text)
    assert all(torch.equal(got[k], t) for k, t in text.items())
