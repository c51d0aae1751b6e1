"""The flags every ``anyspeed posttrain`` stage shares: ``--stage`` and LoRA (MindSpeed-LLM's
names and defaults). Each stage adds its own in its folder."""

from __future__ import annotations

import argparse

from anyspeed.models.lora import TARGETS as LORA_TARGETS

# the stages of ``anyspeed posttrain`` (the table, anyspeed.stages.table, has a row for each)
POSTTRAIN_STAGES = (
    "sft",
    "dpo",
    "simpo",
    "orm",
    "prm",
    "grpo",
    "ppo",
    "distill",
    "vlm",
    "vlm_grpo",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--stage`` and the LoRA flags."""
    g = p.add_argument_group("post-training")
    g.add_argument(
        "--stage",
        choices=POSTTRAIN_STAGES,
        default=None,
        help=f"what to train: {', '.join(POSTTRAIN_STAGES)}",
    )
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-r", type=int, default=None, help="adapter rank (default 16)")
    g.add_argument("--lora-alpha", type=float, default=None, help="scale alpha / r (default 32)")
    g.add_argument("--lora-dropout", type=float, default=None, help="(default 0)")
    g.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=[],
        help=f"layers to adapt, of {' '.join(LORA_TARGETS)}",
    )
    g.add_argument("--lora-load", default=None, help="a LoRA checkpoint to start the adapters from")
    g.add_argument(
        "--lora-modules-to-save",
        nargs="*",
        default=[],
        help="modules trained in full beside the adapters (e.g. output_layer)",
    )
