"""MoE experts' adapters in PEFT's form (``--save-lora-to-hf``).

transformers 5 holds a layer's experts as two stacked parameters, ``mlp.experts.gate_up_proj``
[experts, 2 x ffn, hidden] and ``mlp.experts.down_proj`` [experts, hidden, ffn], with no module
per expert, so PEFT adapts them through ``target_parameters`` (its ``ParamWrapper``): one
``lora_A`` [experts x r, in] (expert e's rows e*r..e*r+r-1) and one ``lora_B`` [out, r x experts]
(expert e's columns e, e+E, ...) per parameter. An anyspeed expert's fc1 adapter (A on the
hidden size, B on [gate; up]) is exactly one expert's share of ``gate_up_proj``'s, its fc2
adapter one of ``down_proj``'s. With both parameters targeted PEFT wraps ``gate_up_proj``
first, so its adapters sit under ``base_layer``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from anyspeed.convert.errors import ConvertError
from anyspeed.models.config import ModelConfig

_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.\w+\.weight$")
PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}  # in PEFT's wrapping order


class ExpertAdapters:
    """The adapters of every layer's experts, gathered per (experts module, parameter)."""

    def __init__(self, preset: ModelConfig) -> None:
        self.preset = preset
        self.found: dict[tuple[str, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def take(
        self, mg_name: str, hf_names: tuple[Any, ...], a: torch.Tensor, b: torch.Tensor
    ) -> bool:
        """Keep (A, B) when ``hf_names`` (the HF tensors of Megatron weight ``mg_name``) are one
        routed expert's; False (nothing kept) for any other layer."""
        mt = _EXPERT.match(hf_names[0]) if isinstance(hf_names[0], str) else None
        if mt is None or ".local_experts." not in mg_name:
            return False
        target = mg_name.rsplit(".", 2)[-2]
        self.found.setdefault((mt["module"], PARAMS[target]), {})[int(mt["e"])] = (a, b)
        return True

    def tensors(self, prefix: str) -> tuple[dict[str, torch.Tensor], list[str]]:
        """PEFT's tensors (keys under ``prefix``) and its ``target_parameters``."""
        if not self.found:
            return {}, []
        shapes = _live_shapes(self.preset)
        params = sorted({p for _, p in self.found}, key=list(PARAMS.values()).index)
        out: dict[str, torch.Tensor] = {}
        for (module, param), experts in self.found.items():
            live = shapes.get(f"{module}.{param}")
            n = len(experts)
            a_in, b_out = experts[0][0].shape[1], experts[0][1].shape[0]
            if live != (n, b_out, a_in) or sorted(experts) != list(range(n)):
                raise ConvertError(
                    f"--save-lora-to-hf: transformers' {self.preset.family} holds no "
                    f"{module}.{param} of [{n}, {b_out}, {a_in}] for these expert adapters; "
                    "merge them instead (--lora-load without --save-lora-to-hf)"
                )
            a = torch.cat([experts[e][0] for e in range(n)])  # [E * r, in]
            b = torch.stack([experts[e][1] for e in range(n)], dim=-1)  # [out, r, E]
            nested = len(params) == 2 and param == params[0]  # the inner of two wrappers
            stem = f"{prefix}{module}{'.base_layer' if nested else ''}"
            out[f"{stem}.lora_A.weight"] = a.contiguous().clone()
            out[f"{stem}.lora_B.weight"] = b.reshape(b_out, -1).contiguous().clone()
        return out, [f"mlp.experts.{p}" for p in params]


def _live_shapes(preset: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of transformers' model of ``preset`` (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from anyspeed.models.hf import hf_config

    cfg = dict(hf_config(preset))
    kind = cfg.pop("model_type")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **cfg))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
