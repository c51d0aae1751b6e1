"""Torch's Adam inside Megatron's distributed optimizer (no apex/TE): state that checkpoints need.

Megatron's distributed optimizer assumes an optimizer whose per-parameter state exists before the
first step and whose loaded ``step`` is per parameter; torch's Adam has neither. These wrappers
give it exactly the state torch's Adam would create, so training numbers are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def with_initialized_torch_adam_state(state_dict: Callable) -> Callable:
    """Give every parameter torch Adam's fresh state (step 0, zero moments) before reading it.

    Exactly what torch's Adam creates at its first step, so training is unchanged.
    """

    @functools.wraps(state_dict)
    def wrapper(self, *args, **kwargs):
        import torch

        inner = getattr(self, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):
            for group in inner.param_groups:
                for p in group["params"]:
                    st = inner.state[p]
                    if "step" not in st:
                        st["step"] = torch.tensor(0.0)
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state_dict(self, *args, **kwargs)

    return wrapper


def keep_torch_adam_step(set_states: Callable) -> Callable:
    """Give each parameter its own copy of the loaded step, and keep it when setting state.

    Megatron's load gives every parameter the *same* step tensor; torch's Adam increments each
    parameter's step in place, so a shared tensor would advance once per parameter per step
    (wrong bias correction after resume). The reshardable checkpoint keeps the step in the
    param groups, not per parameter, so it is absent from ``tensors``.
    """

    @functools.wraps(set_states)
    def wrapper(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                state["step"] = state["step"].clone()
                tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    return wrapper
