"""Configurations transformers reads differently from how they look (issue 43, item 9).

(a) A config.json with ``rope_parameters`` and a legacy ``rope_scaling``: transformers builds
the model from ``rope_scaling`` alone, filling in what it leaves out. anyspeed's reading is
checked against transformers' own config classes, a Qwen3-Next with legacy YaRN is refused
(not converted as plain RoPE), and a DeepSeek-V2 with legacy YaRN converts to the logits
transformers computes. (b) Megatron-LM stores ``--rope-type`` unset (None): that checkpoint
converts with ``--hf-cfg-dir`` holding a config.json transformers wrote; unset compares as
Megatron-Core's default (checked against Megatron-Core's config classes).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import signal

import pytest
import torch

from anyspeed import safe_pickle
from anyspeed.models.hf import preset_from_hf
from anyspeed.models.hf_rope import hf_rope_parameters
from helpers import convert_ranks

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
DEEPSEEK_YARN = {"type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                 "beta_fast": 32, "beta_slow": 1,
                 "original_max_position_embeddings": 4096}  # fmt: skip
TINY = {"llama": "tiny-llama3", "qwen2": "tiny-qwen2.5", "qwen3": "tiny-qwen3",
        "mixtral": "tiny-mixtral", "deepseek_v3": "tiny-deepseek-v3", "gpt_oss": "tiny-gpt-oss",
        "qwen3_next": "tiny-qwen3-next"}  # fmt: skip
# case -> (family, config.json rope fields, what anyspeed refuses (None: it converts))
CASES = {
    # the case: plain rope_parameters (as transformers 5 writes them) + legacy YaRN
    "qwen3_next-legacy-yarn": (
        "qwen3_next",
        dict(
            max_position_embeddings=1024,
            rope_scaling=YARN,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.25,
            },
        ),
        "rope scaling 'yarn' is not supported",
    ),  # fmt: skip
    "qwen3_next-partial-in-dict-wins": (
        "qwen3_next",
        dict(
            rope_theta=5e5,
            partial_rotary_factor=0.5,
            rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25},
        ),
        None,
    ),  # fmt: skip
    "llama-legacy-llama3-over-plain": (
        "llama",
        dict(
            max_position_embeddings=131072,
            rope_scaling={**LLAMA3, "original_max_position_embeddings": 8192},
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        ),
        None,
    ),  # fmt: skip
    "llama-llama3-without-original-length": (
        "llama",
        dict(
            max_position_embeddings=131072,
            rope_theta=5e5,
            rope_scaling=LLAMA3,
        ),
        "original_max_position_embeddings=131072 is not supported",
    ),  # fmt: skip
    "llama-llama3-on-part-of-each-head": (
        "llama",
        dict(
            rope_theta=5e5,
            partial_rotary_factor=0.5,
            rope_scaling={**LLAMA3, "original_max_position_embeddings": 8192},
        ),
        "llama3 rope scaling of part of each head",
    ),  # fmt: skip
    "llama-legacy-type-key": (
        "llama",
        dict(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}),
        "rope scaling 'linear' is not supported",
    ),  # fmt: skip
    "qwen2-top-level-theta": (
        "qwen2",
        dict(rope_theta=1e6, rope_parameters={"rope_type": "default"}),
        None,
    ),  # fmt: skip
    "qwen3-theta-in-dict-wins": (
        "qwen3",
        dict(rope_theta=1e4, rope_parameters={"rope_theta": 1e6}),
        None,
    ),  # fmt: skip
    "mixtral-class-default-theta": ("mixtral", {}, None),
    "deepseek_v3-legacy-yarn-over-plain": (
        "deepseek_v3",
        dict(
            max_position_embeddings=163840,
            rope_theta=1e4,
            rope_scaling=DEEPSEEK_YARN,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        None,
    ),  # fmt: skip
    "gpt_oss-legacy-yarn-class-default-theta": (
        "gpt_oss",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 32.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            }
        ),
        None,
    ),  # fmt: skip
}
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")


def _config(family: str, fields: dict) -> dict:
    """The family's tiny config.json with these rope fields (and no others)."""
    from anyspeed.models.hf import HF_ARCHITECTURES, hf_config
    from anyspeed.models.presets import get_preset

    cfg = {k: v for k, v in hf_config(get_preset(TINY[family])).items() if k not in _ROPE_KEYS}
    return {**cfg, "architectures": [HF_ARCHITECTURES[family]], **copy.deepcopy(fields)}


def _transformers_rope(cfg: dict) -> dict:
    """The rope_parameters transformers' own config class builds from this config.json."""
    from transformers import AutoConfig

    cfg = copy.deepcopy(cfg)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg).rope_parameters


def _check_model(model, want: dict) -> None:
    """``model`` (anyspeed's reading) applies the RoPE transformers' ``want`` describes."""
    assert model.rotary_base == want["rope_theta"]
    assert model.rotary_percent == want.get("partial_rotary_factor", 1.0)
    kind = want["rope_type"]
    assert (model.rope_scaling or {}).get("factor") == (
        want["factor"] if kind == "llama3" else None
    )
    if model.multi_latent_attention:
        assert model.rope_kind() == ("rope" if kind == "default" else kind)
    else:
        assert model.position_embedding_type == ("yarn" if kind == "yarn" else "rope")
    if kind == "yarn":
        assert model.rotary_scaling_factor == want["factor"]
    if kind == "yarn" and not model.multi_latent_attention:
        assert (
            model.yarn_original_max_position_embeddings == want["original_max_position_embeddings"]
        )


@pytest.mark.parametrize("case", list(CASES))
def test_rope_is_read_as_transformers_reads_it(case):
    """anyspeed's reading of each config equals transformers' (its config class), and the
    model read applies that RoPE or is refused in one line naming it."""
    family, fields, refused = CASES[case]
    cfg = _config(family, fields)
    want = _transformers_rope(cfg)
    assert hf_rope_parameters(cfg, family) == want
    if refused:
        with pytest.raises(ValueError, match=refused):
            preset_from_hf(cfg)
    else:
        _check_model(preset_from_hf(cfg), want)
    if case == "qwen3_next-legacy-yarn":  # the issue: transformers builds YaRN, not plain RoPE
        assert want["rope_type"] == "yarn" and want["factor"] == 4.0
        assert want["original_max_position_embeddings"] == 256


def test_qwen3_next_with_legacy_yarn_is_refused_not_read_as_plain_rope():
    """Megatron-Core's YaRN rotates whole heads and Qwen3-Next a quarter of each: the model
    transformers builds cannot be converted, so it is refused in one line."""
    from anyspeed.models.hf import hf_config
    from anyspeed.models.presets import get_preset

    cfg = {**hf_config(get_preset("tiny-qwen3-next")), "architectures": ["Qwen3NextForCausalLM"]}
    plain = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
             "partial_rotary_factor": cfg.pop("partial_rotary_factor")}  # fmt: skip
    assert preset_from_hf({**cfg, "rope_parameters": plain}).rotary_percent == 0.25
    with pytest.raises(ValueError, match="qwen3_next: rope scaling 'yarn' is not supported"):
        preset_from_hf({**cfg, "rope_parameters": plain, "rope_scaling": YARN})


@pytest.mark.parametrize(
    "mscales",
    [
        {"mscale": 0.707, "mscale_all_dim": 0.707},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
        {"mscale": 0.5},
        {},
        {"mscale_all_dim": 0.5},
    ],  # fmt: skip
)
def test_yarn_scaling_of_a_deepseek_config_is_transformers(mscales):
    """Megatron-Core's cos/sin and softmax scaling for the DeepSeek model anyspeed reads equal
    transformers' (which uses the mscale ratio only when both are set); the one pair Megatron
    cannot express is refused."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor,
        _yarn_get_mscale,
    )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    yarn = {k: v for k, v in DEEPSEEK_YARN.items() if k not in ("mscale", "mscale_all_dim")}
    cfg = _config("deepseek_v3", dict(max_position_embeddings=163840,
                                      rope_scaling={**yarn, **mscales}))  # fmt: skip
    if set(mscales) == {"mscale_all_dim"}:
        with pytest.raises(ValueError, match="mscale_all_dim without mscale is not supported"):
            preset_from_hf(cfg)
        return
    model = preset_from_hf(cfg)
    fields = {k: v for k, v in copy.deepcopy(cfg).items() if k != "model_type"}
    config = AutoConfig.for_model("deepseek_v3", **fields)
    _, cos_sin = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    factor = model.rotary_scaling_factor
    assert math.isclose(
        _yarn_get_concentration_factor(factor, model.mscale, model.mscale_all_dim), cos_sin
    )
    softmax = _yarn_get_mscale(factor, model.mscale_all_dim) ** 2
    assert math.isclose(softmax, yarn_apply_mscale(config.rope_parameters, 1.0))


def test_deepseek_v2_with_legacy_yarn_converts_to_transformers_logits(tmp_path):
    """rope_parameters plain (theta 1e6), legacy rope_scaling YaRN, top-level theta 1e4:
    transformers runs YaRN at 1e4, and so does the converted Megatron model."""
    from anyspeed.convert import hf_to_megatron
    from anyspeed.convert.verify import hf_logits, megatron_logits

    hf = tmp_path / "hf"
    convert_ranks.tiny_hf_model(hf, "tiny-deepseek-v2-lite", seed=1)
    cfg = json.loads((hf / "config.json").read_text())
    yarn = cfg.pop("rope_parameters")
    assert yarn["rope_type"] == "yarn"
    cfg["rope_scaling"] = {k: v for k, v in yarn.items() if k != "rope_theta"}
    cfg.update(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    (hf / "config.json").write_text(json.dumps(cfg))
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(3))
    want = hf_logits(hf, tokens)
    mg = hf_to_megatron(hf, tmp_path / "mg", ckpt_format="legacy")
    got = megatron_logits(mg, tokens)[..., : want.shape[-1]]
    assert want.std() > 0.1 and (got - want).abs().max() <= 1e-4


# -------------------------------------------- (b) Megatron-LM's args with --rope-type unset
def _megatron_lm_args(p, **changes) -> argparse.Namespace:
    """What Megatron-LM's pretrain_gpt.py stores for preset ``p`` (its argument names; flags
    left at their defaults, --rope-type among them, stored as None)."""
    values = dict(
        num_layers=p.num_layers, hidden_size=p.hidden_size, ffn_hidden_size=p.ffn_hidden_size,
        num_attention_heads=p.num_attention_heads, group_query_attention=p.gqa,
        num_query_groups=p.num_query_groups if p.gqa else 1, kv_channels=p.head_dim,
        max_position_embeddings=p.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(p.rotary_base), rotary_percent=1.0, normalization="RMSNorm",
        layernorm_epsilon=p.norm_epsilon, swiglu=True, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=False,
        untie_embeddings_and_output_weights=not p.tie_embeddings,
        padded_vocab_size=p.vocab_size, vocab_size=None, use_rope_scaling=False,
        multi_latent_attention=False, rope_type=None, rotary_scaling_factor=1.0, mscale=1.0,
        mscale_all_dim=0.0, layernorm_zero_centered_gamma=False, moe_layer_freq=1,
        params_dtype=torch.float32, exit_signal=signal.SIGTERM,
    )  # fmt: skip
    return argparse.Namespace(**{**values, **changes})


def test_unset_rope_type_reads_as_megatron_cores_default():
    """None is what Megatron-Core builds: MLATransformerConfig's default for MLA; plain
    attention has no rope_type (Megatron-LM drops the None) and applies RoPE."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    from anyspeed.checkpoint.megatron_lm_args import megatron_lm_model
    from anyspeed.models.presets import get_preset

    assert "rope_type" not in {f for f in TransformerConfig.__dataclass_fields__}
    dense = megatron_lm_model(_megatron_lm_args(get_preset("tiny-llama2")), "ckpt", "llama2")
    assert dense.rope_type == "rope"
    p = get_preset("tiny-deepseek-v2-lite")
    mla = _megatron_lm_args(
        p, multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=p.kv_lora_rank,
        qk_head_dim=p.qk_head_dim, qk_pos_emb_head_dim=p.qk_pos_emb_head_dim,
        v_head_dim=p.v_head_dim, rotary_scaling_factor=40.0, num_experts=None,
    )  # fmt: skip
    model = megatron_lm_model(mla, "ckpt", None)
    assert model.rope_type == MLATransformerConfig.__dataclass_fields__["rope_type"].default


def test_rope_compares_by_what_is_applied():
    """YaRN at factor 1 is RoPE (MLA); plain attention reads no rope_type; a llama3 factor the
    config.json lacks is another model (it was not compared)."""
    from anyspeed.models.presets import get_preset

    mla = get_preset("tiny-deepseek-v2-lite").replace(rotary_scaling_factor=1.0)
    assert mla.replace(rope_type="rope").same_architecture(mla.replace(rope_type="yarn")) == []
    yarn = mla.replace(rope_type="yarn", rotary_scaling_factor=40.0)
    assert yarn.same_architecture(yarn.replace(rope_type="rope")) == ["rope_type"]
    dense = get_preset("tiny-llama2")
    assert dense.same_architecture(dense.replace(rope_type="yarn")) == []
    scaled = dense.replace(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert dense.same_architecture(scaled) == ["rope_scaling"]


def test_megatron_lm_zero_centred_norms_are_read():
    """Megatron-LM stores --apply-layernorm-1p under TransformerConfig's name."""
    from anyspeed.checkpoint.megatron_lm_args import megatron_lm_model
    from anyspeed.models.presets import get_preset

    args = _megatron_lm_args(get_preset("tiny-llama2"), layernorm_zero_centered_gamma=True)
    assert megatron_lm_model(args, "ckpt", "llama2").layernorm_zero_centered_gamma


def test_megatron_lm_checkpoint_converts_with_a_config_json_transformers_wrote(tmp_path):
    """Megatron-LM's args (--rope-type unset) in the rank files, --hf-cfg-dir holding the
    config.json transformers saved: the conversion accepts it and gives the same weights."""
    from safetensors.torch import load_file

    from anyspeed.convert import hf_to_megatron, megatron_to_hf
    from anyspeed.models.presets import get_preset

    hf = tmp_path / "hf"
    convert_ranks.tiny_hf_model(hf, "tiny-llama2")
    assert "rope_parameters" in json.loads((hf / "config.json").read_text())  # transformers 5
    mg = hf_to_megatron(hf, tmp_path / "mg", tp=2, ckpt_format="legacy")
    args = _megatron_lm_args(get_preset("tiny-llama2"), tensor_model_parallel_size=2)
    for rank in sorted((mg / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt")):
        state = safe_pickle.load_torch(rank)
        torch.save({"model": state["model"], "args": args, "iteration": 1}, rank)
    out = megatron_to_hf(mg, tmp_path / "out", hf, model_type_hf="llama2")
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (hf / "config.json").read_text()
    )
    want, got = load_file(hf / "model.safetensors"), {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_megatron_lm_longrope_args_are_read_and_yarns_length_is_not_longrope():
    """MindSpeed-LLM stores LongRoPE's factors as lists of floats with --rope-scaling-type
    longrope (its Phi-3.5 checkpoints): the model is the preset's; a YaRN checkpoint's
    --rope-scaling-original-max-position-embeddings is YaRN's, not a LongRoPE half-set."""
    from anyspeed.checkpoint.megatron_lm_args import megatron_lm_model
    from anyspeed.models.presets import get_preset

    p = get_preset("tiny-phi3")
    longrope = _megatron_lm_args(
        p, rotary_percent=p.rotary_percent, window_size=(p.window_size, 0),
        rope_scaling_type="longrope", long_factor=list(p.longrope_long_factor),
        short_factor=list(p.longrope_short_factor),
        rope_scaling_original_max_position_embeddings=16,
    )  # fmt: skip
    model = megatron_lm_model(longrope, "ckpt", "phi3.5")
    assert model.same_architecture(p) == ["name"]
    yarn = _megatron_lm_args(get_preset("tiny-llama2"), rope_scaling_type="yarn",
                             rope_scaling_original_max_position_embeddings=4096)  # fmt: skip
    assert (
        megatron_lm_model(yarn, "ckpt", "llama2").longrope_original_max_position_embeddings is None
    )
