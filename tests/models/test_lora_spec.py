"""The LoRA spec (``models/lora.py``): the record a LoRA checkpoint keeps reads back as written,
in the format checkpoints already hold, and names the first flag that disagrees."""

from __future__ import annotations

from anyspeed.models import lora


def test_record_round_trip_and_format():
    rec = lora.LoraRecord.of(8, 16.0, ["linear_qkv", "linear_fc1"])
    common = rec.to_common()
    # The format written by every LoRA checkpoint so far: keep it readable.
    assert common == {
        "anyspeed_lora": {"r": 8, "alpha": 16.0, "target_modules": ["linear_fc1", "linear_qkv"]}
    }
    assert lora.LoraRecord.from_common({"iteration": 2, **common}) == rec
    assert lora.LoraRecord.from_common({"iteration": 2}) is None
    assert rec.scale == 2.0


def test_mismatch_names_the_flag():
    rec = lora.LoraRecord.of(4, 8.0, ["linear_proj", "linear_qkv"])
    assert rec.mismatch(r=4, alpha=8, target_modules=["linear_qkv", "linear_proj"]) is None
    assert rec.mismatch(r=None, alpha=None, target_modules=None) is None
    assert rec.mismatch(r=8) == "--lora-r 4, not 8"
    assert rec.mismatch(alpha=4.0) == "--lora-alpha 8.0, not 4.0"
    wrong = rec.mismatch(target_modules=["linear_fc1"])
    assert wrong is not None and wrong.startswith("--lora-target-modules")


def test_targets_of_megatron_weight_names():
    assert lora.target_of("decoder.layers.3.self_attention.linear_qkv.weight") == "linear_qkv"
    assert lora.target_of("decoder.layers.0.mlp.linear_fc2.weight") == "linear_fc2"
    assert lora.target_of("decoder.layers.0.mlp.linear_fc2.bias") is None
    assert lora.target_of("output_layer.weight") is None
    assert lora.adapter_key("decoder.layers.self_attention.linear_qkv.weight", lora.B) == (
        "decoder.layers.self_attention.linear_qkv.lora_B"
    )
