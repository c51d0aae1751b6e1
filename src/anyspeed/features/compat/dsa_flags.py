"""Level-0 feature ``mindspeed-dsa-flags``: MindSpeed-LLM's DeepSeek-V3.2 indexer flags as
Megatron-Core's.

MindSpeed-LLM's DeepSeek-V3.2 scripts switch DeepSeek sparse attention on with
``--enable-dsa-indexer`` and size its lightning indexer with ``--index-n-heads``,
``--index-head-dim``, ``--index-topk`` and ``--indexer-loss-coeff`` (defaults 64, 128, 2048,
1.0). Megatron-Core 0.16.1 reads ``--experimental-attention-variant dsa`` and
``--dsa-indexer-*``. The namespace is rewritten before the model type reads it (once: the
rewrite marks itself done); a Megatron flag given too must agree. Their NPU kernels
(``--use-fused-lightning-indexer``, ``--use-sparse-flash-attn``, ...) are accepted flags.
"""

from __future__ import annotations

import argparse

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag

# MindSpeed-LLM's flag -> (Megatron-Core's field, MindSpeed-LLM's default, type)
_NAMES: dict[str, tuple[str, float, type]] = {
    "index_n_heads": ("dsa_indexer_n_heads", 64, int),
    "index_head_dim": ("dsa_indexer_head_dim", 128, int),
    "index_topk": ("dsa_indexer_topk", 2048, int),
    "indexer_loss_coeff": ("dsa_indexer_loss_coeff", 1.0, float),
}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


class MindSpeedDSAFlags(Feature):
    name = "mindspeed-dsa-flags"
    level = 0
    description = "MindSpeed-LLM's --enable-dsa-indexer / --index-* flags as Megatron's DSA options"
    flags = ("--enable-dsa-indexer",)

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--enable-dsa-indexer",
            action="store_true",
            help="MindSpeed-LLM: = --experimental-attention-variant dsa",
        )
        for src, (dst, default, kind) in _NAMES.items():
            note = f"MindSpeed-LLM: = {_flag(dst)} (its default {default:g})"
            add_flag(parser, _flag(src), type=kind, default=None, help=note)

    def flag_notes(self) -> dict[str, str]:
        pairs = ", ".join(f"{_flag(s)} -> {_flag(d)}" for s, (d, _, _) in _NAMES.items())
        return {"--enable-dsa-indexer": f"--experimental-attention-variant dsa; {pairs}"}

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        if not getattr(args, "enable_dsa_indexer", False):
            given = [s for s in _NAMES if getattr(args, s, None) is not None]
            if given:
                raise FeatureError(f"{_flag(given[0])} needs --enable-dsa-indexer")
            return
        variant = getattr(args, "experimental_attention_variant", None)
        if variant not in (None, "dsa"):
            raise FeatureError(
                f"--enable-dsa-indexer and --experimental-attention-variant {variant} contradict"
            )
        args.experimental_attention_variant = "dsa"
        for src, (dst, default, _) in _NAMES.items():
            value, megatron = getattr(args, src, None), getattr(args, dst, None)
            # Megatron's loss coefficient flag defaults to 0: unset, as a missing size is
            unset = megatron is None or (src == "indexer_loss_coeff" and not megatron)
            if value is not None and not unset and value != megatron:
                raise FeatureError(f"{_flag(src)} {value:g} and {_flag(dst)} {megatron:g} differ")
            setattr(args, dst, value if value is not None else default if unset else megatron)
            setattr(args, src, None)
        args.enable_dsa_indexer = False  # rewritten: later passes read Megatron's flags only
