"""``hf_to_megatron``: an HF directory checked against its family (tensors, target layout) first,
then written one group at a time into a staged directory renamed into place at the end."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from anyspeed.convert import engine
from anyspeed.convert.api import DTYPES, check_target, preset_of, staged_output, with_mtp
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.hf_io import (
    HFCheckpoint,
)
from anyspeed.convert.megatron_io import (
    common_state,
    save_legacy,
)
from anyspeed.convert.reward import RECORD, is_reward_config, reward_mapping
from anyspeed.convert.torch_dist import save_torch_dist
from anyspeed.models.config import ModelConfig, padded_vocab_size
from anyspeed.models.families import mapping_for
from anyspeed.models.hf import HF_ARCHITECTURES


def _mapping(ck: HFCheckpoint, preset: ModelConfig) -> Any:
    """The family's HF <-> Megatron mapping; a ``*ForSequenceClassification`` (a reward model
    with one label) maps its ``score`` head instead of the vocabulary projection."""
    m = mapping_for(preset.family)
    return reward_mapping(m) if is_reward_config(ck.config) else m


def _check_hf_tensors(ck: HFCheckpoint, preset: ModelConfig) -> None:
    """Every tensor the architecture needs is there with the shape config.json implies."""
    m = _mapping(ck, preset)
    want = engine.hf_shapes(m, preset)
    have = {n for n in ck.names if not n.endswith(m.ignored_hf)}
    have -= set(engine.mtp_copies(m, preset))  # copies of the embedding and output layer
    if m.mtp:  # MTP layers left out (--mtp-num-layers)
        kept = preset.num_layers + (preset.mtp_num_layers or 0)
        have = {n for n in have if not engine.hf_layer_at_least(m, n, kept)}
    if preset.tie_embeddings:
        have.discard("lm_head.weight")  # some tied checkpoints store it anyway
    for name in sorted(want):
        if name not in have:
            raise ConvertError(f"{ck.dir}: tensor {name} is missing")
        if ck.shape(name) != want[name]:
            raise ConvertError(
                f"{ck.dir}: tensor {name} has shape {list(ck.shape(name))}, "
                f"config.json implies {list(want[name])}"
            )
    extra = sorted(have - set(want))
    if extra:
        raise ConvertError(
            f"{ck.dir}: unexpected tensor {extra[0]} for {HF_ARCHITECTURES[preset.family]}"
        )


def hf_to_megatron(
    hf_dir: str | Path,
    save_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ckpt_format: str = "torch_dist",
    model_type_hf: str | None = None,
    make_vocab_size_divisible_by: int = 1,
    params_dtype: str | None = None,
    num_layer_list: str | None = None,
    ep: int = 1,
    mtp_num_layers: int | None = None,
    noop_layers: str | None = None,
) -> Path:
    """Convert an HF directory into a Megatron checkpoint at ``save_dir``.

    ``torch_dist`` loads at any layout (``tp`` only sets the vocabulary padding); ``legacy``
    is split for ``tp`` x ``pp``. The vocabulary is padded to a multiple of
    ``make_vocab_size_divisible_by x tp`` with zero rows.
    """
    if ckpt_format not in ("torch_dist", "legacy"):
        raise ConvertError(f"--ckpt-format {ckpt_format}: choose torch_dist or legacy")
    ck = HFCheckpoint(hf_dir)
    if ckpt_format == "legacy" and is_reward_config(ck.config):
        raise ConvertError(
            f"{hf_dir}: a reward model (*ForSequenceClassification) converts to --ckpt-format "
            "torch_dist only"
        )
    preset = with_mtp(preset_of(ck.config, model_type_hf), ck.names, mtp_num_layers)
    counts = check_target(preset, tp, pp, num_layer_list, ep, ckpt_format, noop_layers)
    _check_hf_tensors(ck, preset)
    if Path(save_dir).exists():
        raise ConvertError(f"--save-dir {save_dir} already exists (nothing was written)")
    m = _mapping(ck, preset)
    padded = padded_vocab_size(preset.vocab_size, max(1, make_vocab_size_divisible_by), tp)
    mg_preset = dataclasses.replace(preset, vocab_size=padded)
    dtype = DTYPES[params_dtype] if params_dtype else ck.dtype("model.embed_tokens.weight")

    def read(name: str) -> torch.Tensor:
        return ck.get(name, mapped=True).to(dtype)

    def group(
        g: engine.Group, stacked: bool = False, keep: Callable[[str], bool] | None = None
    ) -> dict[str, torch.Tensor | engine.Stacked]:
        return engine.to_megatron(m, preset, g, read, padded, stacked, keep)

    extra = {
        "hf_config_json": json.dumps(ck.config),
        "hf_vocab_size": preset.vocab_size,
        "expert_model_parallel_size": ep,
        **({RECORD: {"num_labels": 1}} if is_reward_config(ck.config) else {}),
    }
    with staged_output(save_dir) as tmp:
        if ckpt_format == "torch_dist":
            common = common_state(mg_preset, 0, extra)
            groups = (group(g, True) for g in engine.groups(preset))
            save_torch_dist(tmp, mg_preset, dtype, groups, common, is_reward_config(ck.config))
        else:
            starts = [sum(counts[:s]) for s in range(pp + 1)]

            def stage(
                s: int, keep: Callable[[str], bool] | None = None
            ) -> Iterator[dict[str, torch.Tensor | engine.Stacked]]:
                if s == 0:
                    yield group(engine.EMBED, True, keep)
                for i in range(starts[s], starts[s + 1]):
                    yield group(i, True, keep)
                if s == pp - 1:
                    for j in range(preset.mtp_num_layers or 0):  # MTP: on the last stage
                        yield group(preset.num_layers + j, True, keep)
                    if preset.mtp_num_layers and pp > 1:  # with its copy of the embedding
                        yield group(engine.EMBED, True, keep)
                    yield group(engine.HEAD, True, keep)
                    if preset.tie_embeddings and pp > 1:  # the last stage's copy of the tie
                        emb = group(engine.EMBED, True)["embedding.word_embeddings.weight"]
                        yield {"output_layer.weight": emb}

            save_legacy(tmp, mg_preset, tp, counts, stage, common_state(mg_preset, 1, extra), ep)
    return Path(save_dir)
