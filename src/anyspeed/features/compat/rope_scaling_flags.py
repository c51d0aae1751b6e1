"""Level-0 feature ``mindspeed-rope-flags``: MindSpeed-LLM's RoPE flags as Megatron's.

``--use-rotary-position-embeddings`` (Megatron-LM's legacy spelling, in MindSpeed-LLM's recipes)
is ``--position-embedding-type rope``, as Megatron-LM's ``validate_args`` makes it.

MindSpeed-LLM's DeepSeek scripts describe YaRN RoPE with ``--rope-scaling-type yarn`` and
``--rope-scaling-*`` values; Megatron-Core's multi-latent attention reads ``--rope-type yarn``,
``--rotary-scaling-factor``, ``--mscale`` and ``--mscale-all-dim``. The namespace is rewritten
before the model type reads it, in every entry path. Megatron-Core 0.16.1 fixes YaRN's original
context (4096) and its beta values (32, 1): other values are a one-line error, not ignored.

Its Phi-3.5 scripts describe LongRoPE with ``--rope-scaling-type longrope``, ``--short-factor``,
``--long-factor`` and ``--rope-scaling-original-max-position-embeddings``: anyspeed's own
architecture flags under those names (:mod:`anyspeed.models.longrope`), which need all three
together. ``--longrope-freqs-type mul | outer`` are two spellings of the same frequencies;
MiniCPM3's ``--long-mscale`` / ``--short-mscale`` (an attention factor per set) are refused.
Megatron-LM's own GPTModel has no LongRoPE: in its training loop the flag is one line.
"""

from __future__ import annotations

import argparse

from anyspeed.argv import factor_list
from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag

_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


class MindSpeedRopeFlags(Feature):
    name = "mindspeed-rope-flags"
    level = 0
    description = "MindSpeed-LLM's --rope-scaling-* YaRN flags as Megatron's MLA rope options"
    flags = (
        "--rope-scaling-type",
        "--use-rotary-position-embeddings",
        "--beta-fast",
        "--beta-slow",
        "--longrope-freqs-type",
        "--long-mscale",
        "--short-mscale",
    )

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--use-rotary-position-embeddings",
            action="store_true",
            help="Megatron-LM's legacy name: = --position-embedding-type rope",
        )
        add_flag(
            parser,
            "--rope-scaling-type",
            type=str,
            default=None,
            choices=("yarn", "longrope"),
            help="MindSpeed-LLM: yarn = --rope-type yarn; longrope: Phi-3.5's LongRoPE",
        )
        add_flag(
            parser,
            "--longrope-freqs-type",
            choices=("mul", "outer"),
            default="mul",
            help="MindSpeed-LLM: how LongRoPE divides the frequencies (the same values)",
        )
        for flag in ("--long-mscale", "--short-mscale"):
            add_flag(parser, flag, type=float, default=None, help="MiniCPM3's: not supported")
        for flag in ("--long-factor", "--short-factor"):  # (architecture flags in anyspeed's)
            add_flag(parser, flag, type=factor_list, default=None, help="LongRoPE's factors")
        add_flag(
            parser,
            "--rope-scaling-mscale",
            type=float,
            default=None,
            help="MindSpeed-LLM: = --mscale",
        )
        add_flag(
            parser,
            "--rope-scaling-mscale-all-dim",
            type=float,
            default=None,
            help="MindSpeed-LLM: = --mscale-all-dim",
        )
        for key, want in _FIXED.items():
            flag = f"--rope-scaling-{key.replace('_', '-')}"
            note = f"MindSpeed-LLM: YaRN's must be {want:g} (Megatron-Core fixes it)"
            kind = int if key == "original_max_position_embeddings" else float
            add_flag(parser, flag, type=kind, default=None, help=note)
        for key in ("beta_fast", "beta_slow"):  # MindSpeed-LLM's DeepSeek recipes' spelling
            note = f"YaRN: must be {_FIXED[key]:g} (Megatron-Core fixes it)"
            add_flag(parser, f"--{key.replace('_', '-')}", type=float, default=None, help=note)

    def flag_notes(self) -> dict[str, str]:
        return {
            "--rope-scaling-type yarn": "--rope-type yarn, --rope-scaling-factor -> "
            "--rotary-scaling-factor, --rope-scaling-mscale(-all-dim) -> --mscale(-all-dim)",
            "--use-rotary-position-embeddings": "--position-embedding-type rope",
            "--rope-scaling-type longrope": "LongRoPE (anyspeed's; --short-factor, "
            "--long-factor, --rope-scaling-original-max-position-embeddings)",
        }

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        if getattr(args, "use_rotary_position_embeddings", False):
            args.position_embedding_type = "rope"
        for key in ("beta_fast", "beta_slow"):
            given, want = getattr(args, key, None), _FIXED[key]
            if given is not None and float(given) != want:
                raise FeatureError(
                    f"--{key.replace('_', '-')} {given:g}: Megatron-Core 0.16.1 fixes it to "
                    f"{want:g}"
                )
        kind = getattr(args, "rope_scaling_type", None)
        _check_longrope(args, kind)
        if kind != "yarn":
            return
        for key, want in _FIXED.items():
            given = getattr(args, f"rope_scaling_{key}", None)
            if given is not None and float(given) != want:
                raise FeatureError(
                    f"--rope-scaling-{key.replace('_', '-')} {given:g}: "
                    f"Megatron-Core 0.16.1 fixes it to {want:g}"
                )
        args.rope_type = "yarn"
        factor = getattr(args, "rope_scaling_factor", None)
        if factor is not None:
            args.rotary_scaling_factor = factor
        for src, dst in (
            ("rope_scaling_mscale", "mscale"),
            ("rope_scaling_mscale_all_dim", "mscale_all_dim"),
        ):
            if getattr(args, src, None) is not None:
                setattr(args, dst, getattr(args, src))
        args.rope_scaling_type = None  # rewritten: later checks read Megatron's flags only
        args.rope_scaling_original_max_position_embeddings = None  # (LongRoPE's field)


def _check_longrope(args: argparse.Namespace, kind: str | None) -> None:
    """FeatureError for LongRoPE's flags without ``--rope-scaling-type longrope`` (they would
    be ignored) and for MiniCPM3's per-set attention factors."""
    for flag in ("--long-mscale", "--short-mscale"):
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            raise FeatureError(
                f"{flag}: an attention factor per LongRoPE set (MiniCPM3's) is not supported; "
                "anyspeed's LongRoPE takes transformers' one factor from the lengths"
            )
    factors = [f for f in ("long_factor", "short_factor") if getattr(args, f, None) is not None]
    if factors and kind != "longrope":
        flag = "--" + factors[0].replace("_", "-")
        raise FeatureError(f"{flag} is LongRoPE's: add --rope-scaling-type longrope")


def refuse_longrope_in_megatron_lm(args: argparse.Namespace) -> None:
    """FeatureError when Megatron-LM's own model builder is asked for LongRoPE."""
    if getattr(args, "rope_scaling_type", None) == "longrope":
        raise FeatureError(
            "--rope-scaling-type longrope runs in `anyspeed pretrain` / `anyspeed posttrain` "
            "(Megatron-LM's GPTModel has no LongRoPE): run it there"
        )
