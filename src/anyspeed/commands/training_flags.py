"""The training flags of an inference command line, checked rather than refused.

MindSpeed-LLM's ``generate_*.sh`` / ``evaluate_*.sh`` scripts (and Megatron-LM's) describe the
model again and pass their training switches: ``--swiglu --disable-bias-linear
--num-layers 48 ... --micro-batch-size 1 --attention-dropout 0.0 --use-flash-attn --spec ...``.
``anyspeed generate`` / ``evaluate`` take the model from the checkpoint. Every flag they do not
define themselves is parsed by ``anyspeed pretrain``'s parser (a flag neither knows is one
line), MindSpeed-LLM's spellings are rewritten to Megatron's as for training, and each
architecture value given is checked against the checkpoint's model (a mismatch is one line).
The rest (dropout, batch sizes, kernels, the expert layout) do not change decoding; one note
names them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from anyspeed.errors import UsageError
from anyspeed.models.config import ARCH_FLAGS, ModelConfig

# the spelling features whose rewrites describe the model (MindSpeed-LLM's names -> Megatron's)
_SPELLINGS = (
    "mindspeed-moe-flags",
    "mindspeed-rope-flags",
    "mindspeed-dsa-flags",
    "mindspeed-qwen3-next-flags",
    "mindspeed-gemma2-flags",
)
# The context window, not the weights: MindSpeed-LLM's scripts set it to their --seq-length.
_NOT_CHECKED = ("max_position_embeddings",)
_PATTERNS = {"moe_layer_freq": "moe_layers", "linear_attention_freq": "linear_attention_layers"}


def parse(parser: argparse.ArgumentParser, argv: list[str], prog: str) -> argparse.Namespace:
    """``argv`` parsed by the command's ``parser``; the flags it does not define parsed by the
    training parser into ``args.arch_given`` (field -> value, the architecture given) and
    ``args.set_aside`` (the other flags' names). UsageError for a flag neither knows."""
    from anyspeed.stages.arguments import build_parser, unsupported_flag

    args, rest = parser.parse_known_args(argv)
    args.arch_given, args.set_aside = {}, []
    if not rest:
        return args
    training = build_parser()
    bad = unsupported_flag(rest, parser, training, prog=prog)
    if bad:
        raise UsageError(bad)
    ns, stray = training.parse_known_args(rest)
    if stray:
        raise UsageError(f"unrecognized arguments: {' '.join(stray)}")
    spellings = _spelling_features()
    args.arch_given = _architecture(ns, training.parse_args([]), spellings)
    flags = [t.split("=", 1)[0] for t in rest if t.startswith("--")]
    probe = argparse.ArgumentParser(add_help=False)
    for feature in spellings:
        feature.add_arguments(probe)
    described = {flag for action in probe._actions for flag in action.option_strings}
    arch = {row.flag for row in ARCH_FLAGS} | described  # they describe the model: checked
    args.set_aside = [f for f in dict.fromkeys(flags) if f not in arch]
    return args


def _spelling_features() -> list[Any]:
    """The features that rewrite MindSpeed-LLM's names for the model into Megatron's."""
    from anyspeed import features

    return [f for f in features.registry.build() if f.name in _SPELLINGS]


def _architecture(
    given: argparse.Namespace, defaults: argparse.Namespace, spellings: list[Any]
) -> dict[str, Any]:
    """The architecture fields ``given`` sets (after the MindSpeed-LLM rewrites) to another
    value than the parser's defaults do."""
    for ns in (given, defaults):
        _rewrite(ns, spellings)
    out = {}
    for row in ARCH_FLAGS:
        if not row.arch or row.field in _NOT_CHECKED:
            continue
        value = row.read(given)
        if value != row.read(defaults):
            out[row.field] = value
    return out


def _rewrite(ns: argparse.Namespace, spellings: list[Any]) -> None:
    from anyspeed.device import detect
    from anyspeed.features.base import FeatureError

    device = detect()
    for feature in spellings:
        try:
            feature.validate(ns, device)
        except FeatureError as exc:
            raise UsageError(str(exc)) from None


def check(args: argparse.Namespace, model: ModelConfig) -> None:
    """UsageError when an architecture value given disagrees with the checkpoint's model."""
    for field, value in getattr(args, "arch_given", {}).items():
        row = next(r for r in ARCH_FLAGS if r.field == field)
        have = getattr(model, field)
        if field in _PATTERNS:  # "1" and "[1]*4" name the same layers
            try:
                other = model.replace(**{field: value})
                same = getattr(model, _PATTERNS[field])() == getattr(other, _PATTERNS[field])()
            except ValueError:
                same = False
        else:
            same = value == have
        if not same:
            shown = "given" if row.type is None else value
            raise UsageError(
                f"{row.flag} {shown} does not match the checkpoint ({have}); drop the flag or "
                "load the matching checkpoint"
            )


def note(args: argparse.Namespace, prog: str) -> None:
    """One line naming the training flags that do not change decoding (launcher or rank 0)."""
    from anyspeed.launch import reports_here

    if getattr(args, "set_aside", None) and reports_here():
        names = args.set_aside
        shown = " ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
        print(
            f"{prog}: note: training flags set aside (the checkpoint holds the model; its "
            f"architecture flags were checked against it): {shown}",
            file=sys.stderr,
        )
