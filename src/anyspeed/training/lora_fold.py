"""LoRA adapters folded into their weights, for inference (``anyspeed generate --lora-load``).

Each adapted layer's weight shard becomes ``W + (alpha / r) * B A`` on its own rank: a column
layer's ``lora_B`` rows and a row layer's ``lora_A`` columns are the weight's own shard, so the
local product is exactly the merged weight's shard (a gated fc1's [gate; up] rows included). A
``GroupedMLP``'s experts fold expert by expert into ``weight1`` / ``weight2``. The adapters,
their hooks and the checkpoint views then leave the model, which decodes as a plain one (the
lean decode step runs only where no layer has a hook).
"""

from __future__ import annotations

import torch

from anyspeed.training import lora


def fold_adapters(chunk: torch.nn.Module) -> int:
    """Fold every adapter of ``chunk`` (after :func:`~anyspeed.training.lora.apply_lora` and
    the adapters' load) into its weight and remove it; the number of layers folded."""
    folded = 0
    for mod in list(chunk.modules()):
        if hasattr(mod, "lora_adapters"):
            _fold_grouped(mod)
            folded += 1
        elif hasattr(mod, "lora_A") and hasattr(mod, "lora_key"):
            _fold_linear(mod)
            folded += 1
    for name in ("sharded_state_dict", "load_state_dict", "lora_view"):
        chunk.__dict__.pop(name, None)  # the adapters views: the chunk's own methods again
    return folded


@torch.no_grad()
def _add(weight: torch.Tensor, delta: torch.Tensor) -> None:
    weight.copy_((weight.float() + delta.float()).to(weight.dtype))


def _fold_linear(mod: torch.nn.Module) -> None:
    _add(mod.weight, mod.lora_B.float() @ mod.lora_A.float() * mod.lora_scale)
    for key, hook in list(mod._forward_hooks.items()):
        if hook is lora._hook:
            del mod._forward_hooks[key]
    del mod.lora_A, mod.lora_B
    mod.__dict__.pop("sharded_state_dict", None)
    for attr in (
        "lora_key",
        "lora_scale",
        "lora_dropout",
        "lora_column",
        "lora_expert",
        "lora_whole",
    ):
        mod.__dict__.pop(attr, None)


def _fold_grouped(mlp: torch.nn.Module) -> None:
    adapters = mlp.lora_adapters
    n, h = mlp.num_local_experts, mlp.config.hidden_size
    weights = {"linear_fc1": mlp.weight1.view(n, h, -1), "linear_fc2": mlp.weight2.view(n, -1, h)}
    for target, experts in adapters.parts.items():
        for e, adapter in enumerate(experts):
            delta = adapter.lora_B.float() @ adapter.lora_A.float() * adapters.scale  # [out, in]
            _add(weights[target][e], delta.t())  # GroupedMLP holds each expert as [in, out]
    del mlp.lora_adapters
    mlp.__dict__.pop("sharded_state_dict", None)
