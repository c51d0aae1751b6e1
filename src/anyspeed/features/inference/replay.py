"""Module hooks the lean decode step replays where the module calls it bypasses would run them.

The step (:mod:`.decode_step`) computes a layer's attention and MLP from their weights, so
hooks on those modules would not run. A hook marked :func:`replayable` is called by the step
at the same point with the same arguments' meaning: a layer's forward pre-hook (with kwargs;
it may hand the layer another ``rotary_pos_emb`` table), a forward hook on ``self_attention``
or ``mlp`` (on ``(output, None)``), a forward pre-hook on the attention core's
``scale_mask_softmax`` (on ``(scores, None)``: elementwise on the scaled scores, before the
mask) and a forward hook on the output layer (on ``(logits, None)``). Any other hook on a
module the step bypasses (a LoRA adapter's, a user's) makes it stand aside for Megatron's
forward. Gemma's traits (``models/gemma.py``) are hooks of these kinds.
"""

from __future__ import annotations

import inspect
from typing import Any

MARK = "_anyspeed_decode_replays"


def replayable(hook: Any) -> Any:
    """Mark ``hook`` (a function, a ``functools.partial`` or a method's function) as one the
    decode step may call in place of the bypassed module's call; returns it."""
    setattr(hook.__func__ if inspect.ismethod(hook) else hook, MARK, True)
    return hook


def _hooks(module: Any, pre: bool) -> list[Any]:
    return list((module._forward_pre_hooks if pre else module._forward_hooks).values())


def _all_marked(hooks: list[Any]) -> bool:
    return all(getattr(h, MARK, False) for h in hooks)


def replayable_layer(layer: Any) -> bool:
    """Whether every hook on the modules of ``layer`` the step bypasses is one it replays at a
    point where it calls it (any hook elsewhere inside the layer: False)."""
    attn, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    core = getattr(attn, "core_attention", None)
    softmax = getattr(core, "scale_mask_softmax", None)
    points = {
        (id(layer), True),
        (id(attn), False),
        (id(mlp), False),
        (id(softmax), True),
    }
    for module in layer.modules():
        for pre in (True, False):
            hooks = _hooks(module, pre)
            if hooks and ((id(module), pre) not in points or not _all_marked(hooks)):
                return False
    return True


def head_replayable(head: Any) -> bool:
    """Whether the output layer carries only forward hooks the step replays."""
    return not _hooks(head, True) and _all_marked(_hooks(head, False))


def layer_rope(layer: Any, table: Any) -> Any:
    """The rotary table the layer's pre-hooks hand it in place of ``table``."""
    kwargs = {"rotary_pos_emb": table}
    for hook in _hooks(layer, True):
        result = hook(layer, (), kwargs)
        if result is not None:
            kwargs = result[1]
    return kwargs["rotary_pos_emb"]


def outputs(module: Any, args: tuple, out: Any) -> Any:
    """``out`` (a tensor) through ``module``'s forward hooks, given as ``(out, None)``."""
    for hook in _hooks(module, False):
        result = hook(module, args, (out, None))
        if result is not None:
            out = result[0]
    return out


def scores(softmax: Any, values: Any) -> Any:
    """Scaled attention scores through the softmax module's pre-hooks (before the mask)."""
    for hook in _hooks(softmax, True) if softmax is not None else []:
        result = hook(softmax, (values, None))
        if result is not None:
            values = result[0]
    return values
