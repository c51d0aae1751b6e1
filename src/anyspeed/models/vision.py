"""Vision-language models: LLaVA (a GPT language model, a CLIP or SigLIP tower, an MLP projector).

:class:`LlavaConfig` is what transformers' ``LlavaConfig`` describes, in Megatron's terms: the
language model is an ordinary :class:`ModelConfig` of a family anyspeed converts, the tower a
:class:`VisionConfig`. Only the tower layers whose output the language model sees are built
(``vision_feature_layer``); the HF layers past them and the tower's unused post-norm (and
SigLIP's pooling head) are kept as frozen tensors so that a model converts back bit-identical.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from anyspeed.models.config import ModelConfig

VISION_KINDS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP or SigLIP vision tower (transformers' ``vision_config``)."""

    kind: str  # "clip" | "siglip"
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int  # the layers the language model sees the output of (built and trained)
    num_attention_heads: int
    image_size: int
    patch_size: int
    norm_epsilon: float = 1e-5
    activation: str = "quick_gelu"  # HF hidden_act
    hf_num_layers: int = 0  # the layers the HF tower holds (0: num_layers)
    siglip_head: bool = False  # SigLIP's attention-pooling head (kept, never used by LLaVA)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def held_layers(self) -> int:
        return self.hf_num_layers or self.num_layers


@dataclass(frozen=True)
class LlavaConfig:
    """A LLaVA model: language model, vision tower, projector and image token."""

    language: ModelConfig
    vision: VisionConfig
    image_token_id: int
    drop_class_token: bool = True  # HF vision_feature_select_strategy "default"
    projector_activation: str = "gelu"

    @property
    def image_seq_len(self) -> int:
        """Embeddings one image becomes in the language model's sequence."""
        cls = self.vision.kind == "clip" and not self.drop_class_token
        return self.vision.num_patches + int(cls)

    def with_language(self, **changes: Any) -> LlavaConfig:
        return dataclasses.replace(self, language=dataclasses.replace(self.language, **changes))


RECORD = "anyspeed_llava"  # the checkpoint entry a vlm run writes (tower, image token, rule)


def record(cfg: LlavaConfig, hf_config: dict[str, Any] | None = None) -> str:
    """``cfg`` less its language model (recorded as every run's model) as checkpoint JSON, with
    the HF config.json it came from (so the checkpoint converts back on its own)."""
    import json

    return json.dumps(
        {
            "vision": dataclasses.asdict(cfg.vision),
            "drop_class_token": cfg.drop_class_token,
            "image_token_id": cfg.image_token_id,
            "hf_config": hf_config,
        }
    )


def from_record(text: str, language: ModelConfig | None) -> LlavaConfig:
    """Inverse of :func:`record` with the checkpoint's language model."""
    import json

    rec = json.loads(text)
    rec.pop("hf_config", None)
    vision = VisionConfig(**rec.pop("vision"))
    return LlavaConfig(language=language, vision=vision, **rec)  # type: ignore[arg-type]


def _int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be an integer (got {value!r})")
    return value


def vision_from_hf(vc: dict[str, Any], feature_layer: Any) -> VisionConfig:
    """The tower transformers' ``vision_config`` describes, cut at ``vision_feature_layer``."""
    kind = VISION_KINDS.get(vc.get("model_type", ""))
    if kind is None:
        raise ValueError(
            f"vision_config.model_type {vc.get('model_type')!r} is not supported "
            f"(choose one of {', '.join(VISION_KINDS)})"
        )
    act = vc.get("hidden_act", "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"vision_config.hidden_act {act!r} is not supported "
            f"(choose one of {', '.join(ACTIVATIONS)})"
        )
    layers = _int(vc, "num_hidden_layers", "vision_config")
    if not isinstance(feature_layer, int) or isinstance(feature_layer, bool):
        raise ValueError(
            f"vision_feature_layer {feature_layer!r}: only one layer (an integer) "
            "is supported, not a list of layers"
        )
    used = layers + 1 + feature_layer if feature_layer < 0 else feature_layer
    if not 1 <= used <= layers:
        raise ValueError(f"vision_feature_layer {feature_layer} selects no tower layer of {layers}")
    return VisionConfig(
        kind=kind,
        hidden_size=_int(vc, "hidden_size", "vision_config"),
        ffn_hidden_size=_int(vc, "intermediate_size", "vision_config"),
        num_layers=used,
        num_attention_heads=_int(vc, "num_attention_heads", "vision_config"),
        image_size=_int(vc, "image_size", "vision_config"),
        patch_size=_int(vc, "patch_size", "vision_config"),
        norm_epsilon=float(vc.get("layer_norm_eps", 1e-5)),
        activation=act,
        hf_num_layers=layers,
        siglip_head=kind == "siglip" and bool(vc.get("vision_use_head", True)),
    )


def llava_from_hf(config: dict[str, Any]) -> LlavaConfig:
    """The model a ``LlavaForConditionalGeneration`` config.json describes; ValueError (one
    line) for what Megatron's LLaVAModel cannot express."""
    from anyspeed.models.hf import preset_from_hf

    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r}: choose default or full")
    vision = vision_from_hf(
        config.get("vision_config") or {}, config.get("vision_feature_layer", -2)
    )
    if vision.kind == "siglip" and strategy == "default":
        raise ValueError(
            "vision_feature_select_strategy 'default' with a SigLIP tower drops a "
            "patch (SigLIP has no class token): only 'full' is supported"
        )
    act = config.get("projector_hidden_act", "gelu")
    if act != "gelu" or config.get("multimodal_projector_bias", True) is not True:
        raise ValueError(
            f"projector_hidden_act {act!r} / multimodal_projector_bias: only the "
            "gelu projector with biases is supported"
        )
    text = dict(config.get("text_config") or {})
    text.setdefault("architectures", None)
    language = preset_from_hf(text, name="hf-llava")
    token = config.get("image_token_id", config.get("image_token_index"))
    if not isinstance(token, int) or not 0 <= token < language.vocab_size:
        raise ValueError(
            f"image_token_id {token!r} is not a token of the vocabulary ({language.vocab_size})"
        )
    return LlavaConfig(
        language=language,
        vision=vision,
        image_token_id=token,
        drop_class_token=strategy == "default",
    )


def extra_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    """HF tower tensors the Megatron model keeps frozen and never runs (names under the
    tower): the layers past the used ones, the post-norm and SigLIP's pooling head."""
    h, f = v.hidden_size, v.ffn_hidden_size
    one = {
        "layer_norm1.weight": (h,),
        "layer_norm1.bias": (h,),
        "layer_norm2.weight": (h,),
        "layer_norm2.bias": (h,),
        "mlp.fc1.weight": (f, h),
        "mlp.fc1.bias": (f,),
        "mlp.fc2.weight": (h, f),
        "mlp.fc2.bias": (h,),
    }
    for p in ("q", "k", "v", "out"):
        one[f"self_attn.{p}_proj.weight"], one[f"self_attn.{p}_proj.bias"] = (h, h), (h,)
    out = {
        f"encoder.layers.{i}.{k}": s
        for i in range(v.num_layers, v.held_layers)
        for k, s in one.items()
    }
    out["post_layernorm.weight"], out["post_layernorm.bias"] = (h,), (h,)
    if v.siglip_head:
        out.update(
            {
                "head.probe": (1, 1, h),
                "head.attention.in_proj_weight": (3 * h, h),
                "head.attention.in_proj_bias": (3 * h,),
                "head.attention.out_proj.weight": (h, h),
                "head.attention.out_proj.bias": (h,),
                "head.layernorm.weight": (h,),
                "head.layernorm.bias": (h,),
                "head.mlp.fc1.weight": (f, h),
                "head.mlp.fc1.bias": (f,),
                "head.mlp.fc2.weight": (h, f),
                "head.mlp.fc2.bias": (h,),
            }
        )
    return out


def extra_key(hf_name: str) -> str:
    """The parameter name of a kept HF tower tensor (module names cannot hold dots)."""
    return hf_name.replace(".", "__")


def hf_name_of_extra(key: str) -> str:
    return key.replace("__", ".")


def tiny_llava(kind: str = "clip", **language: Any) -> LlavaConfig:
    """A LLaVA a CPU trains in seconds: tiny LLaMA language model, 2-layer tower, 32x32 images."""
    from anyspeed.models.presets import get_preset

    lm = dataclasses.replace(get_preset("tiny-llama"), name="tiny-llava", **language)
    vision = VisionConfig(
        kind=kind,
        hidden_size=32,
        ffn_hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        activation="quick_gelu" if kind == "clip" else "gelu_pytorch_tanh",
        hf_num_layers=2,
    )
    return LlavaConfig(
        language=lm,
        vision=vision,
        image_token_id=lm.vocab_size - 1,
        drop_class_token=kind == "clip",
    )
