"""Level-0 feature ``o2-optimizer`` (``--o2-optimizer``, MindSpeed-LLM's): Adam's moments kept
in bfloat16.

Adam keeps two fp32 moments per parameter (8 bytes, next to 4 of fp32 main weights). MindSpeed-
LLM's ``--o2-optimizer`` stores them in bf16 and computes each step in fp32 (the moments upcast,
updated, rounded back): half of the optimizer state. Here the torch Adam(W) that Megatron's
optimizer wraps (no apex/TE) steps that way: same math as torch's single-tensor AdamW, the
moments rounded to bf16 after each step. A checkpoint holds them as they are (bf16); states
loaded or initialised in fp32 (Megatron's) become bf16 at the next step. ``--o2-gradient``
(registered by MindSpeed-LLM without a use) is an accepted flag.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag
from anyspeed.patching import PatchManager

STATE_DTYPE = torch.bfloat16


class BF16MomentAdamW(torch.optim.AdamW):
    """torch's AdamW (or Adam: ``decoupled=False``) whose moments are stored in bf16."""

    decoupled = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of torch's single-tensor Adam(W) in fp32, the moments stored in bf16."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.tensor(0.0)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                st[key] = torch.zeros_like(p, dtype=STATE_DTYPE)
            elif st[key].dtype != STATE_DTYPE:  # loaded or initialised in fp32
                st[key] = st[key].to(STATE_DTYPE)
        st["step"] += 1
        t = float(st["step"])
        grad = p.grad.float()
        if self.decoupled:
            p.mul_(1 - lr * wd)
        elif wd:
            grad = grad.add(p, alpha=wd)
        m = st["exp_avg"].float().lerp_(grad, 1 - beta1)
        v = st["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        st["exp_avg"].copy_(m)
        st["exp_avg_sq"].copy_(v)


class BF16MomentAdam(BF16MomentAdamW):
    """Adam with L2 weight decay (Megatron's ``--no-decoupled-weight-decay``)."""

    decoupled = False


class O2Optimizer(Feature):
    name = "o2-optimizer"
    level = 0
    flags = ("--o2-optimizer",)
    description = "Adam's moments in bf16 (MindSpeed-LLM's --o2-optimizer): half the state"

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(parser, "--o2-optimizer", action="store_true", help=self.description)

    def requested(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "o2_optimizer", False))

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        if not self.requested(args):
            return
        if getattr(args, "optimizer", "adam") != "adam":
            raise FeatureError(f"--o2-optimizer is for Adam, not --optimizer {args.optimizer}")
        for flag in ("use_precision_aware_optimizer", "optimizer_cpu_offload", "swap_optimizer"):
            if getattr(args, flag, False):
                raise FeatureError(
                    f"--o2-optimizer and --{flag.replace('_', '-')} exclude each other"
                )

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        pm.register_wrap(
            "megatron.core.optimizer.get_megatron_optimizer",
            _bf16_moments,
            feature=self.name,
            reason="the torch Adam(W) inside steps with its moments in bf16",
        )


def _bf16_moments(get_megatron_optimizer: Callable) -> Callable:
    @functools.wraps(get_megatron_optimizer)
    def build(*args: Any, **kwargs: Any) -> Any:
        optimizer = get_megatron_optimizer(*args, **kwargs)
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(opt, "optimizer", None)
            if type(inner) is torch.optim.AdamW:
                inner.__class__ = BF16MomentAdamW
            elif type(inner) is torch.optim.Adam:
                inner.__class__ = BF16MomentAdam
            elif inner is not None:
                raise FeatureError(
                    f"--o2-optimizer steps torch's Adam(W); this run's optimizer is "
                    f"{type(inner).__name__} (apex/Transformer Engine): drop --o2-optimizer"
                )
        return optimizer

    return build
