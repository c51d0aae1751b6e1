"""HF ``LlavaForConditionalGeneration`` <-> Megatron ``LLaVAModel`` tensors.

The language model maps through its family's declarative mapping (the shared engine); the tower
and the projector are mapped here, in the names of transformers' in-memory model
(``model.vision_tower.*``). Files spell them in one of two other layouts, read and written
through :func:`hf_name`: ``vision_tower.*`` / ``language_model.model.*`` (what transformers 5
saves) and ``vision_tower.vision_model.*`` (the published llava-hf checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from anyspeed.convert import engine
from anyspeed.models.families import mapping_for
from anyspeed.models.vision import LlavaConfig, extra_key, extra_shapes

TOWER, PROJ, LM = "model.vision_tower.", "model.multi_modal_projector.", "model.language_model."
_FILE = {
    "model.multi_modal_projector.": "multi_modal_projector.",
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
}
LAYOUTS = {
    "model": {},  # the in-memory names
    "saved": {**_FILE, "model.vision_tower.": "vision_tower."},
    "hub": {**_FILE, "model.vision_tower.": "vision_tower.vision_model."},
}


def layout_of(names: Iterable[str]) -> str:
    """Which of :data:`LAYOUTS` a checkpoint's tensor names are in."""
    names = list(names)
    if any(n.startswith("vision_tower.vision_model.") for n in names):
        return "hub"
    return "saved" if any(n.startswith("vision_tower.") for n in names) else "model"


def hf_name(name: str, layout: str) -> str:
    """``name`` (in-memory layout) as a checkpoint in ``layout`` spells it."""
    for new, there in LAYOUTS[layout].items():
        if name.startswith(new):
            return there + name[len(new) :]
    return name


def _lm_hf(name: str) -> str:
    """A family mapping's HF name (``model.*`` / ``lm_head.*``) inside the LLaVA model."""
    return LM + name[len("model.") :] if name.startswith("model.") else name


def _layer_map(cfg: LlavaConfig) -> dict[str, str]:
    """Megatron tower name -> HF tower name, the fused QKV left out."""
    out = {
        "conv1.weight": "embeddings.patch_embedding.weight",
        "position_embeddings.weight": "embeddings.position_embedding.weight",
    }
    if cfg.vision.kind == "siglip":
        out["conv1.bias"] = "embeddings.patch_embedding.bias"
    else:
        out.update({"ln_pre.weight": "pre_layrnorm.weight", "ln_pre.bias": "pre_layrnorm.bias"})
    per_layer = {
        "input_layernorm.{}": "layer_norm1.{}",
        "pre_mlp_layernorm.{}": "layer_norm2.{}",
        "self_attention.linear_proj.{}": "self_attn.out_proj.{}",
        "mlp.linear_fc1.{}": "mlp.fc1.{}",
        "mlp.linear_fc2.{}": "mlp.fc2.{}",
    }
    for i in range(cfg.vision.num_layers):
        for mg, hf in per_layer.items():
            for p in ("weight", "bias"):
                out[f"decoder.layers.{i}.{mg.format(p)}"] = f"encoder.layers.{i}.{hf.format(p)}"
    for name in extra_shapes(cfg.vision):
        out[f"kept.{extra_key(name)}"] = name
    return out


def _fuse_heads(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    """[q; k; v] -> Megatron's per-head [q_h; k_h; v_h] rows (every head its own group)."""
    q = parts[0]
    return torch.stack([p.reshape(heads, -1, *q.shape[1:]) for p in parts], 1).reshape(
        -1, *q.shape[1:]
    )


def _split_heads(t: torch.Tensor, heads: int) -> list[torch.Tensor]:
    return [x.reshape(-1, *t.shape[1:]) for x in t.reshape(heads, 3, -1, *t.shape[1:]).unbind(1)]


def to_megatron(
    cfg: LlavaConfig, read: Callable[[str], torch.Tensor], vocab_rows: int
) -> dict[str, torch.Tensor]:
    """The whole (TP1) Megatron state of ``cfg`` from HF tensors ``read(current-layout name)``;
    the vocabulary padded with zero rows to ``vocab_rows``."""
    lm, m = cfg.language, mapping_for(cfg.language.family)
    out: dict[str, torch.Tensor] = {}
    for g in engine.groups(lm):
        part = engine.to_megatron(m, lm, g, lambda n: read(_lm_hf(n)), vocab_rows)
        out.update({f"language_model.{k}": engine.materialize(v) for k, v in part.items()})
    v = cfg.vision
    for mg, hf in _layer_map(cfg).items():
        out[f"vision_model.{mg}"] = read(TOWER + hf)
    if v.kind == "clip":
        out["vision_model.class_token"] = read(TOWER + "embeddings.class_embedding").reshape(
            1, 1, -1
        )
    for i in range(v.num_layers):
        for p in ("weight", "bias"):
            qkv = [read(f"{TOWER}encoder.layers.{i}.self_attn.{x}_proj.{p}") for x in "qkv"]
            out[f"vision_model.decoder.layers.{i}.self_attention.linear_qkv.{p}"] = _fuse_heads(
                qkv, v.num_attention_heads
            )
    for j, fc in ((1, "linear_fc1"), (2, "linear_fc2")):
        for p in ("weight", "bias"):
            out[f"vision_projection.encoder.{fc}.{p}"] = read(f"{PROJ}linear_{j}.{p}")
    return out


def to_hf(cfg: LlavaConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors (current layout) from the whole Megatron state; vocabulary rows cut."""
    lm, m = cfg.language, mapping_for(cfg.language.family)
    out: dict[str, torch.Tensor] = {}
    sub = {
        k[len("language_model.") :]: t for k, t in state.items() if k.startswith("language_model.")
    }
    for g in engine.groups(lm):
        part = engine.to_hf(m, lm, g, sub, lm.vocab_size)
        out.update({_lm_hf(k): engine.materialize(t) for k, t in part.items()})
    v = cfg.vision
    for mg, hf in _layer_map(cfg).items():
        out[TOWER + hf] = state[f"vision_model.{mg}"]
    if v.kind == "clip":
        out[TOWER + "embeddings.class_embedding"] = state["vision_model.class_token"].reshape(-1)
    for i in range(v.num_layers):
        for p in ("weight", "bias"):
            fused = state[f"vision_model.decoder.layers.{i}.self_attention.linear_qkv.{p}"]
            for x, t in zip("qkv", _split_heads(fused, v.num_attention_heads), strict=True):
                out[f"{TOWER}encoder.layers.{i}.self_attn.{x}_proj.{p}"] = t
    for j, fc in ((1, "linear_fc1"), (2, "linear_fc2")):
        for p in ("weight", "bias"):
            out[f"{PROJ}linear_{j}.{p}"] = state[f"vision_projection.encoder.{fc}.{p}"]
    return {k: t.contiguous() for k, t in out.items()}


_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def shard(name: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s part of whole Megatron tensor ``name`` (as the model holds it)."""
    if name.startswith("language_model."):
        return engine.materialize(engine.shard_tp(name[len("language_model.") :], t, tp, rank))
    if tp == 1:
        return t
    if name.endswith(_COLUMN):
        return t.chunk(tp, dim=0)[rank]
    if name.endswith(_ROW):
        return t.chunk(tp, dim=1)[rank]
    return t


def merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard` over the TP ranks' parts."""
    if name.startswith("language_model."):
        return engine.materialize(engine.merge_tp(name[len("language_model.") :], parts))
    if len(parts) == 1:
        return parts[0]
    if name.endswith(_COLUMN):
        return torch.cat(parts, dim=0)
    if name.endswith(_ROW):
        return torch.cat(parts, dim=1)
    return parts[0]


def _global_names(model: torch.nn.Module) -> Callable[[str], str]:
    """A pipeline stage's parameter name -> the whole model's (its decoder layers numbered
    from the stage's first layer; a last stage's copy of tied embeddings is the embedding)."""
    lm = getattr(model, "language_model", None)
    layers = getattr(getattr(lm, "decoder", None), "layers", None)
    offset = layers[0].layer_number - 1 if layers else 0
    head = "language_model.output_layer.weight"
    tied = lm is not None and lm.share_embeddings_and_output_weights

    def name(k: str) -> str:
        pre = "language_model.decoder.layers."
        if k.startswith(pre) and offset:
            i, rest = k[len(pre) :].split(".", 1)
            return f"{pre}{int(i) + offset}.{rest}"
        return "language_model.embedding.word_embeddings.weight" if k == head and tied else k

    return name


def load_into(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    tp: int,
    rank: int,
    split: Callable[[str, torch.Tensor, int, int], torch.Tensor] | None = None,
) -> None:
    """Copy the whole Megatron ``state`` into this TP rank's ``model`` (or pipeline stage),
    each tensor cut by ``split(name, tensor, tp, rank)`` (LLaVA's :func:`shard` by default);
    every parameter must be covered (a missing one names itself)."""
    split = split or shard
    name = _global_names(model)
    own = {name(k): v for k, v in model.state_dict().items()}
    skip = ("_extra_state", ".lora_A", ".lora_B")  # LoRA adapters start on their own
    missing = [k for k in own if k not in state and not k.endswith(skip)]
    if missing:
        raise KeyError(f"no tensor for {missing[0]} (and {len(missing) - 1} more)")
    with torch.no_grad():
        for k, dst in own.items():
            if k in state:
                src = split(k, state[k], tp, rank)
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"{k}: shape {tuple(src.shape)} where the model has {tuple(dst.shape)}"
                    )
                dst.copy_(src)
