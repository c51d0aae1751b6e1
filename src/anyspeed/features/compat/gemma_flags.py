"""Level-0 feature ``mindspeed-gemma2-flags``: MindSpeed-LLM's Gemma 2 window flag as
Megatron-Core's.

MindSpeed-LLM's Gemma 2 scripts pass ``--interleave-sliding-window W``: odd-numbered layers
(1, 3, ...) attend to the W keys up to their row, the others to all keys. Megatron-Core 0.16.1
spells it ``--window-size W-1`` (keys before the row) with ``--window-attn-skip-freq 2``
(layer numbers 2 divides are full attention), as transformers' ``sliding_window`` and
``layer_types`` do. The namespace is rewritten before the model is read (once: the rewrite
marks itself done); a Megatron flag given too must agree. The rest of Gemma 2's flags
(``--post-norm``, ``--gelu-tanh``, ``--query-pre-attn-scalar``, ``--attn-logit-softcapping``,
``--output-logit-softcapping``, ``--input-embeds-norm``) are anyspeed's architecture flags
under MindSpeed-LLM's names; ``--add-rmsnorm-offset`` is ``mindspeed-qwen3-next-flags``'.
"""

from __future__ import annotations

import argparse

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag


class MindSpeedGemmaFlags(Feature):
    name = "mindspeed-gemma2-flags"
    level = 0
    description = (
        "MindSpeed-LLM's --interleave-sliding-window W as --window-size W-1 "
        "--window-attn-skip-freq 2"
    )
    flags = ("--interleave-sliding-window",)

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--interleave-sliding-window",
            type=int,
            default=None,
            help="MindSpeed-LLM: every other layer (1, 3, ...) attends to the last W keys only",
        )

    def flag_notes(self) -> dict[str, str]:
        return {"--interleave-sliding-window": "--window-size W-1 --window-attn-skip-freq 2"}

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        width = getattr(args, "interleave_sliding_window", None)
        if width is None:
            return
        if width < 1:
            raise FeatureError(f"--interleave-sliding-window must be >= 1, got {width}")
        window, freq = (
            getattr(args, "window_size", None),
            getattr(args, "window_attn_skip_freq", None),
        )
        if window not in (None, width - 1):
            raise FeatureError(
                f"--interleave-sliding-window {width} and --window-size {window} differ "
                f"(the window of {width} keys is --window-size {width - 1})"
            )
        if freq not in (None, "2"):
            raise FeatureError(
                f"--interleave-sliding-window windows every other layer; "
                f"--window-attn-skip-freq {freq} says otherwise: remove one"
            )
        args.window_size, args.window_attn_skip_freq = width - 1, "2"
        args.interleave_sliding_window = None  # rewritten: later passes read Megatron's flags
