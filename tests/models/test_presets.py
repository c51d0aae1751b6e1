"""Model presets vs. published sizes, Hugging Face's own model classes and Megatron's GPTModel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anyspeed.models import PRESETS, apply_preset, get_preset
from anyspeed.models.hf import hf_config
from anyspeed.testing import run_distributed
from helpers import trainer_ranks

# Parameter counts published for the released checkpoints (model cards / safetensors indexes).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen2-57b-a14b": 57_408_658_944,
    "qwen3-30b-a3b": 30_532_122_624,
    "deepseek-v2-lite": 15_706_484_224,
}


def hf_parameters(name: str) -> int:
    """Count the parameters of the transformers model built (on the meta device) from the
    preset's HF config: an implementation independent of anyspeed's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = hf_config(get_preset(name))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_sizes(name):
    assert hf_parameters(name) == PUBLISHED[name]
    assert get_preset(name).num_parameters() == PUBLISHED[name]


# transformers' default configurations, documented as these checkpoints' style (their text models)
DEFAULT_CONFIG_OF = {"qwen3.5-9b": "qwen3_5_text", "qwen3.5-35b-a3b": "qwen3_5_moe_text"}


@pytest.mark.parametrize("name", list(DEFAULT_CONFIG_OF))
def test_preset_sizes_match_transformers_defaults(name):
    """Qwen3.5's published sizes, as transformers' own default configuration builds them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(DEFAULT_CONFIG_OF[name]))
    assert get_preset(name).num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_matches_transformers(name):
    """(transformers' models have no multi-token prediction layers; Megatron's count of them
    is checked on the tiny presets below)"""
    preset = get_preset(name)
    assert preset.num_parameters() - preset.mtp_parameters() == hf_parameters(name)


TINY = [n for n in PRESETS if n.startswith("tiny-")]


@pytest.fixture(scope="module")
def megatron_counts():
    """Parameter counts of Megatron's GPTModel for every tiny preset, built in one process."""
    (counts,) = run_distributed(trainer_ranks.megatron_preset_parameters, 1, names=TINY,
                                timeout=180)  # fmt: skip
    return counts


@pytest.mark.parametrize("name", TINY)
def test_megatron_gpt_from_tiny_preset_matches_transformers(megatron_counts, name):
    """Megatron's count includes the MTP layers (tiny-deepseek-v3 has one); transformers' not."""
    preset = get_preset(name)
    assert megatron_counts[name] == hf_parameters(name) + preset.mtp_parameters()
    assert megatron_counts[name] == preset.num_parameters()


def test_explicit_flags_override_the_preset():
    argv = apply_preset(["--model", "qwen2.5-7b", "--num-layers", "4", "--lr", "1e-4"])
    assert argv.count("--num-layers") == 1 and argv[argv.index("--num-layers") + 1] == "4"
    assert argv[argv.index("--hidden-size") + 1] == "3584"
    assert "--add-qkv-bias" in argv and "--model" not in argv
    assert argv[-2:] == ["--lr", "1e-4"]
    assert apply_preset(["--lr", "1"]) == ["--lr", "1"]


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="--model qwen9: unknown preset"):
        apply_preset(["--model", "qwen9"])


def test_moe_layer_freq_compares_by_meaning():
    """Megatron-LM stores --moe-layer-freq as an int or a list, anyspeed as text: one model."""
    from anyspeed.models import get_preset

    p = get_preset("tiny-qwen3-moe")
    n = p.num_layers
    as_int = dataclasses.replace(p, moe_layer_freq=1)
    as_list = dataclasses.replace(p, moe_layer_freq=f"[1]*{n}")
    assert as_int.moe_layer_freq == "1" and as_int == dataclasses.replace(p, moe_layer_freq="1")
    assert p.same_architecture(as_list) == [] and p.same_architecture(as_int) == []
    other = dataclasses.replace(p, moe_layer_freq=f"[0]*1+[1]*{n - 1}")
    assert p.same_architecture(other) == ["moe_layer_freq"]
