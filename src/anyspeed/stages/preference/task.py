"""Preference optimisation on pairwise data: the ``dpo`` and ``simpo`` stages (full or LoRA).

DPO compares the policy's summed answer log-probabilities with a frozen reference's: a copy at
the training layout with a checkpoint's weights (``--ref-model``, default ``--load``), or under
LoRA the policy itself with its adapters off (no second copy). The reference pass runs forward
only, between optimizer steps, through the shared log-prob forward; it has no optimizer state
and no gradients. SimPO needs no reference.

The loss is the mean over the global batch's pairs, the same at every layout and micro-batch
size: each micro-batch hands Megatron's schedule (sum of pair losses, pair count) and the
gradients are divided once by the global pair count. Under context parallelism each answer's
log-probability sum is completed across the CP ranks (an all-reduce with gradients) before the
non-linear loss. The formulas: :mod:`anyspeed.stages.preference.loss`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.checkpoint.record import hf_vocab
from anyspeed.errors import UsageError
from anyspeed.models.logprobs import token_logprobs
from anyspeed.stages.common.losses import cp_sum, per_token_loss
from anyspeed.stages.common.reference import (
    add_reference_arguments,
    packed_transforms,
    reference,
    reference_model,
    reference_record,
)
from anyspeed.stages.preference import loss as P
from anyspeed.training.packed_rows import model_inputs, to_rows
from anyspeed.training.task import FrozenModel, LossFunc, StagePlan, Task

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def add_pairwise_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every pairwise stage (dpo, simpo, orm) takes (``--use-remove-padding`` is
    the instruction stages' own, which they take too)."""
    g = p.add_argument_group("pairwise data")
    g.add_argument(
        "--is-pairwise-dataset",
        action="store_true",
        help="--data-path names a preprocessed pairwise (chosen/rejected) dataset",
    )
    g.add_argument(
        "--use-dynamic-bsz",
        action="store_true",
        help="with --use-remove-padding: split each step's pairs into micro-batches of at most "
        "--max-packing-token-size tokens (balanced) instead of --micro-batch-size each",
    )
    g.add_argument(
        "--max-packing-token-size",
        type=int,
        default=None,
        help="with --use-dynamic-bsz: tokens per micro-batch at most (default: --micro-batch-size "
        "pairs of --seq-length, a padded micro-batch's)",
    )


def add_dpo_arguments(p: argparse.ArgumentParser) -> None:
    """``--stage dpo``'s flags (MindSpeed-LLM's names and defaults)."""
    g = p.add_argument_group("DPO")
    g.add_argument(
        "--dpo-loss-type",
        choices=P.DPO_LOSSES,
        default="sigmoid",
        help="sigmoid (DPO), hinge (SLiC) or ipo",
    )
    g.add_argument("--dpo-beta", type=float, default=0.1, help="the KL strength beta")
    g.add_argument(
        "--dpo-label-smoothing", type=float, default=0.0, help="cDPO's label noise, in [0, 0.5)"
    )
    g.add_argument(
        "--pref-ftx",
        type=float,
        default=0.0,
        help="weight of the chosen answer's SFT loss added to the DPO loss",
    )
    add_reference_arguments(g)


def add_simpo_arguments(p: argparse.ArgumentParser) -> None:
    """``--stage simpo``'s flags (MindSpeed-LLM v2.2's names and defaults)."""
    g = p.add_argument_group("SimPO")
    g.add_argument("--simpo-loss-type", choices=P.SIMPO_LOSSES, default="sigmoid")
    g.add_argument("--simpo-beta", type=float, default=2.5, help="the reward scale beta")
    g.add_argument(
        "--gamma-beta-ratio", type=float, default=1.4, help="the target margin gamma over beta"
    )
    g.add_argument("--simpo-label-smoothing", type=float, default=0.0, help="in [0, 0.5)")
    g.add_argument(
        "--pref-ftx",
        type=float,
        default=0.0,
        help="weight of the chosen answer's SFT loss added to the loss",
    )


@dataclass(frozen=True)
class PreferenceConfig:
    """The checked flags of a preference stage."""

    kind: str  # dpo | simpo | orm
    prefix: str
    loss_type: str
    beta: float
    label_smoothing: float
    pref_ftx: float
    gamma_beta_ratio: float = 0.0
    reference: str | None = None  # a checkpoint root; None: the run's --load
    reference_iteration: int | None = None
    lora: Any = None  # anyspeed.training.lora.LoRAConfig
    pad_id: int = 0
    packing: Any = None  # remove-padding (rl.packing.Packing), None: padded rows


def plan(args: argparse.Namespace, kind: str) -> StagePlan:
    """The preference checks (before the generic ones); the pairwise data, opened once."""
    from anyspeed.stages.common.instruction_data import one_prefix
    from anyspeed.stages.preference import data as pairwise_data
    from anyspeed.training import lora

    if not args.is_pairwise_dataset:
        raise UsageError(
            f"--stage {kind} trains on pairwise datasets: add --is-pairwise-dataset "
            "(and preprocess with a *PairwiseHandler)"
        )
    prefix = one_prefix(args, "pairwise")
    if args.neat_pack or args.reset_attention_mask:
        raise UsageError(
            f"--stage {kind}: pairwise data is not packed; drop --neat-pack / "
            "--reset-attention-mask"
        )
    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    if variable and args.pipeline_model_parallel_size > 1:
        raise UsageError(
            "--variable-seq-lengths with --pipeline-model-parallel-size > 1 is not "
            "supported; pad to --seq-length (drop the flag)"
        )
    lora_cfg = lora.from_args(args)
    packed = pairwise_data.packing_of(args, kind)
    pairwise_data.check_pairs(prefix)
    data = pairwise_data.open_pairs(prefix)
    pairwise_data.check_lengths(data, prefix, args.seq_length, args.split)
    if kind == "dpo":
        ref, ref_iter = reference(args, lora_cfg, "dpo")
        cfg = PreferenceConfig(
            kind,
            prefix,
            args.dpo_loss_type,
            args.dpo_beta,
            args.dpo_label_smoothing,
            args.pref_ftx,
            reference=ref,
            reference_iteration=ref_iter,
            lora=lora_cfg,
        )
    elif kind == "orm":
        cfg = PreferenceConfig(kind, prefix, "sigmoid", 1.0, 0.0, 0.0)
    else:
        cfg = PreferenceConfig(
            kind,
            prefix,
            args.simpo_loss_type,
            args.simpo_beta,
            args.simpo_label_smoothing,
            args.pref_ftx,
            gamma_beta_ratio=args.gamma_beta_ratio,
            lora=lora_cfg,
        )
    cfg = dataclasses.replace(cfg, packing=packed)
    records = lora_cfg.record().to_common() if lora_cfg else {}
    return StagePlan([pairwise_data.file_prefix(prefix, "chosen_input_ids")], cfg, data, records)


def make_task(run: Run) -> PreferenceTask:
    """The preference task of a checked run."""
    cfg = run.config
    return PreferenceTask(cfg, run.load, hf_vocab(cfg.reference or run.load))


class PreferenceTask(Task):
    """DPO / SimPO on micro-batches of pairs ([chosen rows; rejected rows])."""

    metrics = METRICS

    def __init__(
        self, cfg: PreferenceConfig, load: str | None = None, vocab_size: int | None = None
    ) -> None:
        self.cfg, self.vocab_size = cfg, vocab_size
        self.name, self.loss_key = cfg.kind, f"{cfg.kind} loss"
        self.reference = cfg.reference or load  # full DPO's reference checkpoint

    def transforms(self) -> list[Any]:
        lora = [self.cfg.lora.transform()] if self.cfg.lora else []
        return [per_token_loss, *packed_transforms(self.cfg.packing), *lora]

    def schedule_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int]:
        return seq_length, 2 * micro_batch_size  # a pair is two sequences

    def frozen_models(self) -> dict[str, FrozenModel]:
        if self.cfg.kind != "dpo":
            return {}
        c = self.cfg
        return reference_model(c.lora, self.reference, c.reference_iteration, c.packing)

    def records(self) -> dict[str, Any]:
        if self.cfg.kind != "dpo":
            return {}
        return reference_record(self.cfg.lora, self.reference, self.cfg.reference_iteration)

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        from anyspeed.stages.common.lora_start import lora_start

        return lora_start(self.cfg.lora, run, trainer, scheduler, state)

    def setup(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        tokens, pos, labels, packed = model_inputs(batch)
        output = token_logprobs(
            model, tokens, pos, labels, packed_seq_params=packed, vocab_size=self.vocab_size
        )
        mask, ref = batch["loss_mask"], batch.get("ref_logps")

        def loss_func(logprobs: torch.Tensor):
            # a packed micro-batch's log-probs back in its rows
            return self.pair_loss(to_rows(logprobs, batch), mask, ref)

        return output, loss_func

    def pair_loss(
        self, logprobs: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor | None
    ) -> tuple:
        """(sum of the pair losses, pair count, metrics) of one micro-batch of pairs."""
        mask = mask.float()
        sums = (logprobs.float() * mask).sum(-1)
        ref = torch.zeros_like(sums) if ref is None else ref.to(sums)
        full = cp_sum(torch.stack([sums, ref, mask.sum(-1)]))
        m = sums.shape[0] // 2
        lp = P.PairLogps(
            full[0, :m], full[0, m:], full[1, :m], full[1, m:], full[2, :m], full[2, m:]
        )
        c = self.cfg
        if c.kind == "dpo":
            losses, rc, rr = P.dpo_loss(lp, c.loss_type, c.beta, c.label_smoothing, c.pref_ftx)
        else:
            losses, rc, rr = P.simpo_loss(
                lp, c.loss_type, c.beta, c.gamma_beta_ratio, c.label_smoothing, c.pref_ftx
            )
        total = losses.sum()
        metrics = P.pair_metrics(rc, rr, lp)
        metrics[self.loss_key] = torch.stack(
            [
                total.detach().double(),
                torch.tensor(float(m), dtype=torch.float64, device=total.device),
            ]
        )
        return total, torch.tensor(m, dtype=torch.int, device=total.device), metrics

    def datasets(self, run: Run) -> list[Any]:
        """(train, valid, test): the pairs with each split's row range (or None)."""
        from anyspeed.stages.common.instruction_data import split_datasets

        return split_datasets(run.data, run.args.split)

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Micro-batches of pairs; under DPO each carries the reference's answer log-prob
        sums (this rank's CP share), from one forward-only pass of the frozen reference."""
        from anyspeed.stages.preference.data import batches

        data, rows = dataset
        for micro in batches(data, run.args, rows, consumed, device, self.cfg):
            if self.cfg.kind == "dpo" and trainer is not None:
                logps = trainer.logprobs(micro, model="reference", vocab_size=self.vocab_size)
                if logps is not None:  # the last pipeline stage
                    for b, lp in zip(micro, logps, strict=True):
                        b["ref_logps"] = (lp.float() * b["loss_mask"].float()).sum(-1)
            yield micro
