"""Qwen2-VL / Qwen2.5-VL on Megatron-Core: the vision tower (:mod:`.tower`) and a ``GPTModel``
with mRoPE. The language model's word embeddings of the image (video) pad tokens are replaced,
in order, by the tower's output rows; the 3-D positions come from :mod:`.positions`."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from anyspeed.models.qwen_vl.positions import VisionTokens, mrope_positions
from anyspeed.models.qwen_vl.tower import QwenVisionTower, TowerConfig


class QwenVLModel(MegatronModule):
    """Tokens, pixels and grids -> logits (or per-token loss with ``labels``). Under sequence
    parallelism the embeddings stay whole until the features are in, then are split."""

    def __init__(
        self,
        tower: TowerConfig,
        tower_config: Any,
        language: Any,
        language_config: Any,
        tokens: VisionTokens,
        *,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        from anyspeed.models import gpt

        super().__init__(config=language_config)
        language_config.apply_rope_fusion = False  # the fused RoPE kernels take 1-D positions
        from megatron.core.transformer.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules read
        self.tokens = tokens
        self.pre_process = pre_process  # pipeline: the tower sits on the first stage
        self.vision = QwenVisionTower(tower, tower_config) if pre_process else None
        self.language_model = gpt.build(
            language, language_config, pre_process=pre_process, post_process=post_process
        )
        self.sequence_parallel = bool(language_config.sequence_parallel) and pre_process
        if self.sequence_parallel:  # whole embeddings: the features go in by position
            emb = self.language_model.embedding
            emb.scatter_to_sequence_parallel = emb.reduce_scatter_embeddings = False
            emb.word_embeddings.reduce_scatter_embeddings = False

    def _embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        """The first stage's decoder input: word embeddings, the tower's rows in the pads."""
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)
        for pixels, grid, token in (
            (pixel_values, image_grid_thw, self.tokens.image_token_id),
            (pixel_values_videos, video_grid_thw, self.tokens.video_token_id),
        ):
            if pixels is not None:
                emb = self._scatter(emb, input_ids, token, self.vision(pixels, grid))
        emb = cp_share(emb, seq_dim=0)  # every image whole on each rank, then this rank's part
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """Megatron's pipeline grad sync of tied embeddings reads these off the model."""
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Megatron's schedules hand a stage its input here (no pipeline: None)."""
        self.language_model.set_input_tensor(input_tensor)

    def _scatter(
        self, embeddings: torch.Tensor, input_ids: torch.Tensor, token: int, features: torch.Tensor
    ) -> torch.Tensor:
        """``embeddings`` [s, b, h] with the rows of ``token`` replaced by ``features`` (in
        batch-major reading order); ValueError when the counts differ."""
        where = (input_ids == token).t()  # [s, b]
        count = int(where.sum())
        if count != features.shape[0]:
            kind = "image" if token == self.tokens.image_token_id else "video"
            raise ValueError(
                f"{count} {kind} pad tokens in the prompt for {features.shape[0]} {kind} "
                "features: the tokens must be the processor's (t*h*w / merge**2 per input)"
            )
        order = where.t().reshape(-1).nonzero().squeeze(1)  # batch-major positions
        b = input_ids.shape[0]
        flat = embeddings.transpose(0, 1).reshape(-1, embeddings.shape[-1]).clone()
        flat[order] = features.to(flat.dtype)
        return flat.view(b, -1, embeddings.shape[-1]).transpose(0, 1).contiguous()

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **decoding: Any,
    ) -> torch.Tensor:
        """``attention_mask``: Megatron's [b, 1, q, k] (True hidden) for left-padded decoding
        (None: causal). ``decoding``: Megatron's ``inference_context`` and
        ``runtime_gather_output`` (the positions are then those of every token so far: the
        cache's keys turn at each step)."""
        lm = self.language_model
        if labels is not None:
            labels = cp_share(labels, seq_dim=1)
        if position_ids is None:
            position_ids, _ = mrope_positions(
                input_ids, self.tokens, image_grid_thw, video_grid_thw, second_per_grid_ts
            )
        emb = (
            self._embed(
                input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
            )
            if self.pre_process
            else None
        )
        return lm(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=emb,
            labels=labels,
            **decoding,
        )


def cp_share(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """This context-parallel rank's part of a whole sequence (Megatron's load-balanced
    layout: chunks r and 2*cp-1-r of 2*cp); ``t`` itself at CP 1. Differentiable."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return t
    rank = ps.get_context_parallel_rank()
    chunks = t.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=seq_dim)
