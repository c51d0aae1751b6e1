"""LoRA checkpoints in ``anyspeed convert``: merge the adapters into the base weights, or
export them in PEFT's format.

A LoRA checkpoint (``anyspeed posttrain --lora-target-modules ...``) is a torch_dist checkpoint
holding each adapted layer's ``lora_A`` and ``lora_B`` beside the base tensor names, sharded as
the layer is, with the ``anyspeed_lora`` record (r, alpha, targets: ``models/lora.py``) in its
common state. The merge adds
``(alpha / r) * B @ A`` to each Megatron weight *before* the engine re-lays it out (QKV groups
un-interleaved, gate/up split): on the assembled tensors this equals merging every TP shard on
its own, since B's rows (column layers) or A's columns (row layers) follow the weight's shards.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from anyspeed.convert.errors import ConvertError
from anyspeed.models import lora as spec
from anyspeed.models.config import ModelConfig

PEFT_PREFIX = "base_model.model."


class Adapters:
    """The adapters of one LoRA checkpoint, read per Megatron weight name."""

    def __init__(self, lora_dir: str | Path, preset: ModelConfig, prefix: str = "") -> None:
        """``prefix``: where the language model sits in the checkpoint's model (a
        vision-language model's ``language_model.``); names given to :meth:`pair` carry it."""
        from anyspeed.checkpoint.reads import checkpoint_dir, checkpoint_format, read_common
        from anyspeed.convert.dcp_io import DcpReader
        from anyspeed.convert.torch_dist import checkpoint_keys

        it_dir = checkpoint_dir(lora_dir)
        record = spec.LoraRecord.from_common(read_common(it_dir))
        if record is None or checkpoint_format(it_dir) != "torch_dist":
            raise ConvertError(
                f"--lora-load {lora_dir}: not a LoRA checkpoint of anyspeed "
                f"posttrain (no {spec.RECORD} record)"
            )
        self.record = record
        self.dir, self.it_dir, self.reader = lora_dir, it_dir, DcpReader(it_dir)
        self.key_of = checkpoint_keys(preset)
        self.scale, self.prefix = record.scale, prefix

    def check(self, r: int | None, alpha: float | None, targets: list[str] | None) -> None:
        """The flags given must describe this checkpoint (MindSpeed-LLM passes them)."""
        wrong = self.record.mismatch(r=r, alpha=alpha, target_modules=targets or None)
        if wrong:
            raise ConvertError(f"--lora-load {self.dir} was trained with {wrong}")

    def pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of Megatron weight ``name``; None when it has no adapter."""
        if not name.startswith(self.prefix):
            return None
        name = name[len(self.prefix) :]
        if not spec.adapted(spec.target_of(name), self.record.target_modules):
            return None
        from anyspeed.convert.engine import materialize
        from anyspeed.convert.torch_dist import read_entry

        key, index = self.key_of(name)  # the adapters are keyed and stacked as the weight
        key = self.prefix + key
        a, b = (
            materialize(read_entry(self.reader, spec.adapter_key(key, part), index, self.it_dir))
            for part in (spec.A, spec.B)
        )
        return a, b

    def merged(self, groups: Iterator[tuple[Any, dict]]) -> Iterator[tuple[Any, dict]]:
        """``groups`` with every adapted weight replaced by W + scale * B @ A (in fp32)."""
        from anyspeed.convert.engine import materialize

        for group, tensors in groups:
            for name in list(tensors):
                ab = self.pair(name)
                if ab is not None:
                    w = materialize(tensors[name])
                    delta = ab[1].float() @ ab[0].float() * self.scale
                    tensors[name] = (w.float() + delta).to(w.dtype)
            yield group, tensors


def export_peft(lora_dir: str | Path, save_dir: str | Path, preset: ModelConfig, m: Any) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT saves them: a
    fused Megatron adapter becomes one per HF projection (A shared, B split like the weight);
    a MoE expert's under its checkpoint name (``mlp.experts.3.gate_proj``), the form PEFT
    converts into transformers 5's stacked experts on load."""
    from safetensors.torch import save_file

    from anyspeed.convert import engine
    from anyspeed.models.families.base import Fused

    adapters = Adapters(lora_dir, preset)
    out: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    experts = dense_mlp = False
    for group in engine.groups(preset):
        for mg, dst in engine.entries(m, preset, group).items():
            ab = adapters.pair(mg)
            if ab is None:
                continue
            a, b = ab
            names = dst.parts if isinstance(dst, Fused) else (dst,)
            if not all(isinstance(n, str) for n in names):
                raise ConvertError(
                    f"--save-lora-to-hf: {preset.family}'s experts are stacked in one HF tensor; "
                    "merge the adapters instead (--lora-load without --save-lora-to-hf)"
                )
            expert = ".local_experts." in mg
            experts |= expert
            dense_mlp |= not expert and spec.target_of(mg) in ("linear_fc1", "linear_fc2")
            parts = (
                zip(names, engine.split_fused(dst, b, preset), strict=True)
                if isinstance(dst, Fused)
                else [(dst, b)]
            )
            for hf_name, b_part in parts:
                stem = PEFT_PREFIX + hf_name.removesuffix(".weight")
                out[f"{stem}.{spec.A}.weight"] = a.contiguous().clone()
                out[f"{stem}.{spec.B}.weight"] = engine.materialize(b_part).contiguous().clone()
                modules.add(hf_name.removesuffix(".weight").rsplit(".", 1)[-1])
    if not out:
        raise ConvertError(f"--lora-load {lora_dir}: no adapters found")
    if experts and dense_mlp:
        print(
            "anyspeed convert: warning: the adapters hold MoE experts and dense (or shared-"
            "expert) MLPs: PEFT 0.21 with transformers 5 maps every gate/up/down target onto "
            "the stacked experts and leaves the others out; merge instead (--lora-load without "
            "--save-lora-to-hf) to keep them all",
            file=sys.stderr,
        )
    save = Path(save_dir)
    save.mkdir(parents=True)
    save_file(out, str(save / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapters.record.r,
        "lora_alpha": adapters.record.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(modules),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": None,
        "modules_to_save": None,
    }
    (save / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_lora_to_hf(lora: dict, save_dir: str | Path, model_type_hf: str | None = None) -> None:
    """``--save-lora-to-hf``: the LoRA checkpoint ``lora["load"]`` as a PEFT adapter."""
    from anyspeed.checkpoint.record import read_model
    from anyspeed.models.families import mapping_for

    preset = read_model(lora["load"], model_type_hf)
    Adapters(lora["load"], preset).check(
        lora.get("r"), lora.get("alpha"), lora.get("target_modules")
    )
    if Path(save_dir).exists():
        raise ConvertError(f"--save-dir {save_dir} already exists (nothing was written)")
    export_peft(lora["load"], save_dir, preset, mapping_for(preset.family))
