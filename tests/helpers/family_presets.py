"""Checks the family conversion tests share: a preset against transformers' model of its HF
config, and a tiny random HF model converted in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def assert_preset_is_transformers(name: str, total: float, architecture: str, rel: float) -> None:
    """The preset's parameter count is ``total`` (within ``rel``) and exactly transformers'
    model of its HF config, and that config read back is the preset."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from anyspeed.models.hf import hf_config, preset_from_hf
    from anyspeed.models.presets import PRESETS

    preset = PRESETS[name]
    cfg = hf_config(preset)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert preset.num_parameters() == sum(p.numel() for p in model.parameters())
    assert preset.num_parameters() == pytest.approx(total, rel=rel)
    read = preset_from_hf({**config.to_dict(), "architectures": [architecture]}, name)
    assert read.same_architecture(preset) == []


def converted_tiny(root: Path, preset: str, name: str, tokens: torch.Tensor, seed: int) -> dict:
    """A tiny random HF model of ``preset`` converted by the CLI (with ``--verify``) and back,
    its logits at one process, and transformers' logits."""
    from anyspeed.convert.verify import hf_logits
    from anyspeed.testing import run_distributed
    from helpers import convert_ranks

    convert_ranks.tiny_hf_model(root / "hf", preset, seed=seed)
    case = {"hf": str(root / "hf"), "torch_dist": str(root / "dist"),
            "hf_from_dist": str(root / "back")}  # fmt: skip
    one = run_distributed(convert_ranks.convert_all, 1, cases={name: case}, tokens=tokens,
                          cli_case=name, timeout=300)[0][name]  # fmt: skip
    return {"dir": root, "case": case, "ref": hf_logits(root / "hf", tokens), "one": one}
