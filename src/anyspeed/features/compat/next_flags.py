"""Level-0 feature ``mindspeed-qwen3-next-flags``: MindSpeed-LLM's spelling of Qwen3-Next's
(and its gated-DeltaNet models') architecture as Megatron-Core's flags.

MindSpeed-LLM's ``qwen3_next``, ``qwen3_coder_next`` and ``gated_deltanet`` scripts describe
the hybrid with its own flags; Megatron-Core 0.16.1 has the same model under other names:

* ``--full-attention-interval N``: every N-th layer full attention, the rest gated DeltaNets
  (MindSpeed-LLM's layer-number rule, ``(i + 1) % N == 0``, is Megatron's for an integer
  ``--linear-attention-freq``), the full-attention layers with a sigmoid gate on each head's
  output: ``--experimental-attention-variant gated_delta_net --linear-attention-freq N
  --attention-output-gate``;
* ``--partial-rotary-factor F``: ``--rotary-percent F``;
* ``--mamba-d-conv K``: the DeltaNet's causal convolution, ``--linear-conv-kernel-dim K``;
* ``--add-rmsnorm-offset``: norms scale by ``1 + w``, ``--apply-layernorm-1p``.

(Its router flags, ``--topk-softmax-in-fp32`` and ``--norm-topk-prob``, are
``mindspeed-moe-flags``'.)

``--no-enable-linear-qkv`` (its full-attention layers build their own projections; Megatron's
``linear_qkv`` with the gate holds the same weights, which the converter maps) is accepted with
``--full-attention-interval`` only. The rewrite runs before the model is read, once (it marks
itself done); a Megatron flag given too must agree.
"""

from __future__ import annotations

import argparse

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag

_GDN = "gated_delta_net"


class MindSpeedNextFlags(Feature):
    name = "mindspeed-qwen3-next-flags"
    level = 0
    description = (
        "MindSpeed-LLM's Qwen3-Next flags (--full-attention-interval, --partial-rotary-factor, "
        "--mamba-d-conv, --add-rmsnorm-offset, ...) as Megatron's"
    )
    flags = ("--full-attention-interval", "--partial-rotary-factor", "--add-rmsnorm-offset")

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        ms = "MindSpeed-LLM: "
        add_flag(
            parser,
            "--full-attention-interval",
            type=int,
            default=None,
            help=ms + "every N-th layer gated full attention, the rest gated DeltaNets",
        )
        add_flag(
            parser,
            "--partial-rotary-factor",
            type=float,
            default=None,
            help=ms + "= --rotary-percent",
        )
        add_flag(
            parser,
            "--mamba-d-conv",
            type=int,
            default=None,
            help=ms + "= --linear-conv-kernel-dim (DeltaNet layers)",
        )
        add_flag(
            parser, "--add-rmsnorm-offset", action="store_true", help=ms + "= --apply-layernorm-1p"
        )
        add_flag(
            parser,
            "--topk-softmax-in-fp32",
            action="store_true",
            help=ms + "= --moe-router-dtype fp32",
        )
        add_flag(
            parser,
            "--no-enable-linear-qkv",
            action="store_true",
            help=ms + "its full-attention layers' own projections (with --full-attention-interval)",
        )
        add_flag(
            parser,
            "--loss-compute-mode",
            choices=("default", "chunk"),
            default=None,
            help=ms + "default (chunk: use --cross-entropy-loss-fusion)",
        )

    def flag_notes(self) -> dict[str, str]:
        return {
            "--full-attention-interval": "--experimental-attention-variant gated_delta_net "
            "--linear-attention-freq N --attention-output-gate",
            "--partial-rotary-factor": "--rotary-percent",
            "--add-rmsnorm-offset": "--apply-layernorm-1p",
            "--mamba-d-conv": "--linear-conv-kernel-dim",
        }

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        interval = getattr(args, "full_attention_interval", None)
        if interval:  # MindSpeed-LLM's 0 is its default: no DeltaNet layers
            _hybrid(args, interval)
        elif getattr(args, "no_enable_linear_qkv", False) and (
            getattr(args, "experimental_attention_variant", None) != _GDN
        ):
            raise FeatureError(
                "--no-enable-linear-qkv leaves attention without projections unless "
                "--full-attention-interval builds Qwen3-Next's own: add it or remove the flag"
            )
        if getattr(args, "loss_compute_mode", None) == "chunk":
            raise FeatureError(
                "--loss-compute-mode chunk (MindSpeed-LLM's output layer and loss in sequence "
                "chunks) is not built here: --cross-entropy-loss-fusion computes the loss "
                "chunk-wise without an fp32 copy of the logits"
            )
        conv = getattr(args, "mamba_d_conv", None)
        if conv is not None:
            if getattr(args, "experimental_attention_variant", None) != _GDN:
                raise FeatureError(
                    "--mamba-d-conv sizes gated DeltaNet layers here: add "
                    "--full-attention-interval N (anyspeed's Mamba layers take Megatron's flags)"
                )
            _agree(args, "mamba_d_conv", "linear_conv_kernel_dim", conv, default=4)
        factor = getattr(args, "partial_rotary_factor", None)
        if factor:  # MindSpeed-LLM's 0.0 is its default: whole heads
            _agree(args, "partial_rotary_factor", "rotary_percent", factor, default=1.0)
        if getattr(args, "add_rmsnorm_offset", False):
            args.apply_layernorm_1p = True
        for name in ("full_attention_interval", "mamba_d_conv", "partial_rotary_factor"):
            if hasattr(args, name):
                setattr(args, name, None)  # rewritten: later passes read Megatron's flags
        if hasattr(args, "add_rmsnorm_offset"):
            args.add_rmsnorm_offset = False


def _hybrid(args: argparse.Namespace, interval: int) -> None:
    """``--full-attention-interval N`` as Megatron's DeltaNet hybrid with gated attention."""
    if interval < 1:
        raise FeatureError(f"--full-attention-interval must be >= 1, got {interval}")
    variant = getattr(args, "experimental_attention_variant", None)
    if variant not in (None, _GDN):
        raise FeatureError(
            f"--full-attention-interval and --experimental-attention-variant {variant} contradict"
        )
    freq = getattr(args, "linear_attention_freq", None)
    if freq not in (None, str(interval)):
        raise FeatureError(
            f"--full-attention-interval {interval} and --linear-attention-freq {freq} differ"
        )
    args.experimental_attention_variant = _GDN
    args.linear_attention_freq = str(interval)
    args.attention_output_gate = True


def _agree(args: argparse.Namespace, src: str, dst: str, value: float, default: float) -> None:
    """Set Megatron's ``dst`` from MindSpeed-LLM's ``src`` unless it was given otherwise."""
    have = getattr(args, dst, None)
    if have not in (None, default, value):
        flag = "--" + src.replace("_", "-")
        raise FeatureError(f"{flag} {value:g} and --{dst.replace('_', '-')} {have:g} differ")
    setattr(args, dst, value)
