"""The Qwen2-VL / Qwen2.5-VL vision tower on Megatron-Core's transformer layers.

Pixels arrive as the image processor lays them out: one row of ``C * T * P * P`` values per
patch, patches in 2x2 merge-block order, frames one after another. The patch embedding is a
matmul (HF's bias-free Conv3d with stride = kernel is exactly that). Each layer is Megatron's
local ViT layer (bidirectional attention with qkv and output bias) under a block-diagonal mask:
a frame of an image or video attends only to itself, and in Qwen2.5-VL every layer outside
``fullatt_block_indexes`` only within its window of ``window_size`` pixels, the tokens reordered
so that each window is contiguous. The rotary embedding is 2-D: each head's first quarter of
frequency pairs turn with the patch's row, the second with its column (rotate-half layout). The
merger normalises, joins each 2x2 block into one row and maps it to the language model's width
through a GELU MLP; the output is in the original token order, one row per image token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from anyspeed.models.qwen_vl.config import TowerConfig, tower_from_hf  # noqa: F401 - re-exported


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) of every patch [n, 2], in the processor's merge-block order."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        block = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], 1)
        out.append(block.repeat(t, 1))
    return torch.cat(out)


def window_order(cfg: TowerConfig, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The merged units (2x2 blocks) reordered window by window, and the windows' lengths in
    patches: per frame, windows of ``window_size`` pixels row by row, the edge ones smaller."""
    m = cfg.spatial_merge_size
    ws = cfg.window_size // m // cfg.patch_size
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        units = torch.arange(t * (h // m) * (w // m)).view(t, h // m, w // m) + offset
        for frame in units:
            for r in range(0, frame.shape[0], ws):
                for c in range(0, frame.shape[1], ws):
                    win = frame[r : r + ws, c : c + ws].flatten()
                    order.append(win)
                    lengths.append(win.numel() * m * m)
        offset += units.numel()
    return torch.cat(order), lengths


def block_mask(lengths: list[int]) -> torch.Tensor:
    """[1, 1, n, n] True where attention is cut: between different segments of ``lengths``."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return (seg[:, None] != seg[None, :])[None, None]


def frame_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Patches per frame, for every frame of every input in order."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


class QwenVisionTower(MegatronModule):
    """Pixels [n, patch_dim] and grids [k, 3] -> image tokens [n / merge**2, out_hidden_size]
    (a MegatronModule: its TP-split layers checkpoint as shards, the rest replicated)."""

    def __init__(self, cfg: TowerConfig, config: Any) -> None:
        from megatron.core.transformer.transformer_block import TransformerBlock

        super().__init__(config=config)
        self.cfg = cfg
        self.patch_embed = torch.nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        self.decoder = TransformerBlock(
            config, tower_layer_spec(), post_layer_norm=False, pre_process=True
        )
        norm = torch.nn.LayerNorm if cfg.kind == "qwen2_vl" else torch.nn.RMSNorm
        self.merger_norm = norm(cfg.hidden_size, eps=cfg.norm_epsilon)
        joined = cfg.hidden_size * cfg.spatial_merge_size**2
        self.merger_fc1 = torch.nn.Linear(joined, joined)
        self.merger_fc2 = torch.nn.Linear(joined, cfg.out_hidden_size)
        d = cfg.hidden_size // cfg.num_heads // 2
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rotary(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Rotation angles [n, 1, 1, head_dim]: (row, column) angles, twice (rotate-half)."""
        pos = patch_positions(grid_thw, self.cfg.spatial_merge_size).float()
        angles = (pos[:, :, None] * self.inv_freq).flatten(1)
        return torch.cat([angles, angles], dim=-1)[:, None, None, :]

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One input (image or video) at a time: inputs never attend to each other, so each
        layer's mask is the size of one input, not of the whole batch."""
        sizes = [t * h * w for t, h, w in grid_thw.tolist()]
        parts = pixels.split(sizes)
        return torch.cat([self._one(p, g[None]) for p, g in zip(parts, grid_thw, strict=True)])

    def _one(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg, unit = self.cfg, self.cfg.spatial_merge_size**2
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        rope = self._rotary(grid_thw)
        frames = block_mask(frame_lengths(grid_thw))
        masks = [frames] * cfg.num_layers
        order = None
        if cfg.windowed:
            order, lengths = window_order(cfg, grid_thw)
            x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
            rope = rope.view(-1, unit, *rope.shape[1:])[order].flatten(0, 1)
            windows = block_mask(lengths)
            full = cfg.fullatt_block_indexes
            masks = [frames if i in full else windows for i in range(cfg.num_layers)]
        h = x.unsqueeze(1)  # [s, b=1, hidden]
        for layer, mask in zip(self.decoder.layers, masks, strict=True):
            h, _ = layer(h, attention_mask=mask.to(h.device), rotary_pos_emb=rope.to(h.device))
        h = self.merger_norm(h.squeeze(1)).view(-1, cfg.hidden_size * unit)
        out = self.merger_fc2(F.gelu(self.merger_fc1(h)))
        if order is not None:
            out = out[torch.argsort(order.to(out.device))]
        return out


def tower_layer_spec() -> Any:
    """Megatron's local ViT layer, its attention taking an arbitrary (block-diagonal) mask."""
    import copy

    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    spec = copy.deepcopy(vit_layer_specs.get_vit_layer_with_local_spec())
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return spec


def tower_transformer_config(
    cfg: TowerConfig, layout: Any = None, dtype: torch.dtype = torch.float32, **kw: Any
):
    """Megatron ``TransformerConfig`` of the tower's layers at ``layout``'s TP (the LLaVA
    towers' settings, with Qwen2.5-VL's RMSNorm and biased SwiGLU; ``kw`` overrides)."""
    from anyspeed.layout import Layout
    from anyspeed.models.multimodal import vision_config
    from anyspeed.models.vision import VisionConfig

    qwen2 = cfg.kind == "qwen2_vl"
    v = VisionConfig(
        kind=cfg.kind,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        image_size=0,  # dynamic resolution: no fixed patch count
        patch_size=cfg.patch_size,
        norm_epsilon=cfg.norm_epsilon,
        activation="quick_gelu",
    )
    if not qwen2:
        kw = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, **kw)
    return vision_config(v, layout or Layout(), dtype, **kw)
