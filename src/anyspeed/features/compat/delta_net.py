"""Level-0 feature ``delta-net-compat``: Megatron's gated DeltaNet layer on every device.

Megatron-Core 0.16.1's ``GatedDeltaNet`` (Qwen3-Next's linear attention) refuses to build
without the Triton ``fla`` package and takes its kernel (the chunked gated delta rule) and its
query/key L2 norm from there; its gated output norm, and the attention's output gate
(``--attention-output-gate``), are ``torch.compile``'d at import. Here the
layer gets anyspeed's plain-PyTorch rule (:mod:`anyspeed.features.ops.gated_delta`), which
autograd differentiates on any device, and both gates run eagerly. Where ``fla`` is installed its
kernel is kept (it must agree: ``tests/features/test_gated_delta.py``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.patching import PatchManager

_MODULE = "megatron.core.ssm.gated_delta_net"


def chunk_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fla``'s ``chunk_gated_delta_rule`` signature over anyspeed's chunked rule."""
    from anyspeed.features.ops.gated_delta import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
    )


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``fla``'s query/key L2 norm (eps 1e-6 under the square root), in fp32."""
    from anyspeed.features.ops.gated_delta import l2_normalize

    return l2_normalize(x.float()).to(x.dtype)


def apply_gated_norm(self: Any, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``GatedDeltaNet._apply_gated_norm`` without ``torch.compile``: norm, then the SiLU gate."""
    dtype = x.dtype
    y = self.out_norm(x.reshape(-1, x.shape[-1]))
    y = y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
    return y.to(dtype)


def apply_output_gate(self: Any, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``Attention._apply_output_gate`` without ``torch.compile``: ``x * sigmoid(gate)``."""
    return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


def _has_fla() -> bool:
    try:
        from fla.ops.gated_delta_rule import (  # type: ignore[import-not-found]  # noqa: F401
            chunk_gated_delta_rule,
        )
    except Exception:  # noqa: BLE001 - absent, or broken on this device
        return False
    return True


class DeltaNetCompat(Feature):
    name = "delta-net-compat"
    level = 0
    description = "gated DeltaNet (Qwen3-Next) with the plain-PyTorch delta rule, no fla"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        pm.register_replace(
            f"{_MODULE}.GatedDeltaNet._apply_gated_norm",
            apply_gated_norm,
            feature=self.name,
            reason="torch.compile'd at import: inductor is not on every device",
        )
        from anyspeed.features.inference.delta_net_state import with_state

        pm.register_wrap(
            f"{_MODULE}.GatedDeltaNet.forward",
            with_state,
            feature=self.name,
            reason="generation: Megatron's DeltaNet refuses an inference context; the "
            "convolution's last inputs and the rule's state are carried on it here",
        )
        pm.register_replace(
            "megatron.core.transformer.attention.Attention._apply_output_gate",
            apply_output_gate,
            feature=self.name,
            reason="--attention-output-gate: torch.compile'd at import (inductor needs CUDA)",
        )
        if _has_fla():
            return
        why = "fla (Triton) is not installed: the plain-PyTorch rule stands in"
        for name, new in (
            ("HAVE_FLA", True),
            ("chunk_gated_delta_rule", chunk_rule),
            ("l2norm", l2norm),
        ):
            pm.register_replace(
                f"{_MODULE}.{name}", new, feature=self.name, reason=why, create=name == "l2norm"
            )
