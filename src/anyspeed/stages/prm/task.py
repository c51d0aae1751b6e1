"""The process reward model (``anyspeed posttrain --stage prm``, MindSpeed-LLM's PRM): a causal
language model trained to put its mass, at the token that ends each reasoning step, on the
step's label token (``+`` correct, ``-`` wrong). It stays a plain language model, so its
checkpoint converts to a Hugging Face ``*ForCausalLM`` that scores a solution's steps anywhere.

The loss is the mean over every labelled step of the global batch (one token mean, exact at
every TP/PP/CP/DP layout), as SFT's; full or LoRA. The data: :mod:`anyspeed.stages.prm.data`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.models.logprobs import packed_params, prepared_logits
from anyspeed.stages.common.instruction_checks import check_layout, check_lengths
from anyspeed.stages.common.instruction_data import one_prefix
from anyspeed.stages.common.instruction_task import InstructionTask
from anyspeed.stages.common.losses import token_loss
from anyspeed.stages.prm.data import StepTokens
from anyspeed.stages.prm.loss import step_terms
from anyspeed.training.task import LossFunc, StagePlan

if TYPE_CHECKING:
    from anyspeed.training.run import Run


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The PRM flags (MindSpeed-LLM's names and defaults)."""
    g = p.add_argument_group("process reward model")
    g.add_argument(
        "--placeholder-token",
        default="ки",
        help="the token that ends each step in the data (Math-Shepherd's, the default: ки)",
    )
    g.add_argument(
        "--reward-tokens",
        nargs="+",
        default=None,
        help="the label tokens (e.g. + -): the loss is over their logits only; without them, "
        "over the whole vocabulary",
    )


@dataclass(frozen=True)
class PRMConfig:
    """The checked PRM flags: the dataset prefix, padding, the step tokens and LoRA."""

    prefix: str
    packed: bool
    variable_lengths: bool
    steps: StepTokens
    pad_id: int = 0
    lora: Any = None  # anyspeed.training.lora.LoRAConfig


def plan(args: argparse.Namespace) -> StagePlan:
    """The PRM checks (before the generic ones); the step-labelled data, opened once."""
    from anyspeed.convert.to_hf import PRM_RECORD
    from anyspeed.stages.common import instruction_data as sft_data
    from anyspeed.stages.prm.data import check_steps, step_tokens
    from anyspeed.training import lora

    prefix = one_prefix(args, "step-labelled")
    if args.use_remove_padding:
        from anyspeed.errors import UsageError

        raise UsageError(
            "--stage prm --use-remove-padding is not supported yet (the step scores are read "
            "from padded rows); drop the flag"
        )
    steps = step_tokens(args)
    lora_cfg = lora.from_args(args)
    sft_data.check_files(prefix)
    data = sft_data.open_data(prefix, args.seq_length)
    check_steps(data, prefix, args.seq_length, steps)
    seen = sft_data.survey(data, args.seq_length)
    check_lengths(args, prefix, seen, "a labelled step")
    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    cfg = PRMConfig(prefix, data.packed, variable, steps, lora=lora_cfg)
    check_layout(args, prefix, variable, data, seen)
    records = lora_cfg.record().to_common() if lora_cfg else {}
    records[PRM_RECORD] = {
        "placeholder_token": args.placeholder_token,
        "reward_tokens": list(args.reward_tokens or []),
    }
    return StagePlan([sft_data.file_prefix(prefix, "input_ids")], cfg, data, records)


def make_task(run: Run) -> PRMTask:
    """The PRM task of a checked run."""
    return PRMTask(run.config)


class PRMTask(InstructionTask):
    """Step labels at placeholder tokens, on padded samples or packed (``thd``) sequences."""

    name = "prm"
    metrics = ("acc",)
    aligned = True  # each label sits on its placeholder token

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        params = packed_params(batch)
        output = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=params)
        mask = batch["loss_mask"]

        def loss_func(out: torch.Tensor):
            losses, hits = step_terms(prepared_logits(out), batch["labels"], self.cfg.steps.rewards)
            total, count, report = token_loss(losses, mask)
            right = (hits.reshape(-1) * mask.reshape(-1)).sum()
            return total, count, {self.loss_key: report, "acc": torch.stack([right, report[1]])}

        return output, loss_func
