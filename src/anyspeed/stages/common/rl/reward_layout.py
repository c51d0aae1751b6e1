"""Where ``--reward-model`` runs: its own architecture (read from its checkpoint: a smaller or
larger model than the policy, sharing its tokenizer) at the training layout when that layout
fits it, or whole on every rank (``--reward-tensor-parallel-size 1
--reward-pipeline-parallel-size 1``, MindSpeed-RL's reward worker at TP 1).

Whole, the reward model is built in a second, complete set of process groups made for TP 1 /
PP 1 (:class:`~anyspeed.distributed.parallel_state.ParallelState`, as the rollout model at
another layout is); each rank of a training replica scores a contiguous share of the replica's
sequences and every rank of the replica then has every score.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.models.config import ModelConfig

FLAGS = "--reward-tensor-parallel-size 1 --reward-pipeline-parallel-size 1"


@dataclass(frozen=True)
class RewardSource:
    """A checked ``--reward-model``: its checkpoint, its architecture when it is not the
    policy's, and whether it runs whole on every rank."""

    path: str
    model: ModelConfig | None = None  # None: the policy's architecture
    whole: bool = False


def wants_whole(args: argparse.Namespace) -> bool:
    """Whether ``--reward-*-parallel-size`` ask for the whole model on every rank (checked:
    unset or training's sizes mean the training layout; other sizes must be 1, 1)."""
    train = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    given = (args.reward_tensor_parallel_size, args.reward_pipeline_parallel_size)
    sizes = tuple(t if g is None else g for t, g in zip(train, given, strict=True))
    if sizes == train:
        return False
    if sizes != (1, 1):
        raise UsageError(
            f"--reward-tensor-parallel-size {sizes[0]} --reward-pipeline-parallel-size "
            f"{sizes[1]}: a reward-model layout other than training's must be 1, 1 (the "
            "whole reward model on every rank); leave them unset for the training layout"
        )
    return True


def architecture(
    args: argparse.Namespace, path: str, policy: ModelConfig, flag: str = "--reward-model"
) -> ModelConfig | None:
    """The architecture of the frozen model at ``path`` (a reward model, a teacher; ``flag``
    names it in errors) when it is not the policy's (None when it is), checked: it must read
    the policy's tokens (the same vocabulary)."""
    from anyspeed.checkpoint.errors import ModelRecordError
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.checkpoint.record import hf_vocab, read_model

    try:
        own = read_model(tracked_dir(path) or path)
    except ModelRecordError:
        return None  # no record: the policy's architecture (its shapes are checked)
    own = _normalised(own, policy)
    if own == policy:
        return None
    rm_vocab, vocab = hf_vocab(path) or own.vocab_size, hf_vocab(args.load) or policy.vocab_size
    if rm_vocab != vocab:
        raise UsageError(
            f"{flag} {path!r} reads a vocabulary of {rm_vocab} tokens, the policy "
            f"{vocab}: it must share the policy's tokenizer"
        )
    return own


def _normalised(own: ModelConfig, policy: ModelConfig) -> ModelConfig:
    """``own`` with the fields that do not shape its weights or its forward taken from the
    policy (its name, the context it was set up for), so an equal architecture compares equal
    (dropout and initialisation never compare)."""
    import dataclasses

    return dataclasses.replace(
        own, name=policy.name, max_position_embeddings=policy.max_position_embeddings
    )


def check_fits_layout(
    args: argparse.Namespace,
    own: ModelConfig,
    world: int,
    flag: str = "--reward-model",
    fix: str = f"run it whole on every rank with {FLAGS}",
) -> None:
    """A frozen model of its own architecture (``flag`` names it) at the training layout: its
    heads and layers must divide as the layout splits them, else one line saying ``fix``."""
    from anyspeed.layout import Layout
    from anyspeed.layout.checks import validate_for

    try:
        layout = Layout.from_args(args)
        if own.num_layers != args.num_layers:  # noop slots are the trained model's
            layout = layout.for_other_model()
        validate_for(layout, world, own)
    except ValueError as exc:
        raise UsageError(f"{flag} at the training layout: {exc}; {fix}") from None


class WholeRewardModel:
    """The reward model whole (TP 1, PP 1) on every rank, in its own process groups."""

    def __init__(self, trainer: Any, src: RewardSource) -> None:
        from anyspeed.checkpoint.load import load_weights
        from anyspeed.distributed.groups import timeout_minutes
        from anyspeed.distributed.parallel_state import ParallelState
        from anyspeed.layout import Layout
        from anyspeed.models.reward_head import reward_head
        from anyspeed.stages.common.rl.rollout_model import same_rng
        from anyspeed.training.model_pipeline import build_chunks, unwrap

        self.state = ParallelState.build(timeout_minutes())
        model = src.model or trainer.model_config
        with same_rng(), self.state.entered():
            chunks, _ = build_chunks(model, Layout(), trainer.cfg, (reward_head,), None)
            load_weights(src.path, chunks)
        self.chunk = unwrap(chunks[0]).eval().requires_grad_(False)

    def scores(self, micro: list[dict[str, Any]]) -> torch.Tensor:
        """Each sequence's score [n] on every rank of the replica: the replica's ranks score
        contiguous shares of the micro-batches' rows, then share them."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from anyspeed.stages.common.value_head import last_token

        group = ps.get_model_parallel_group()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        rows = [(b, i) for b in micro for i in range(int(b["tokens"].shape[0]))]
        lo, hi = len(rows) * r // n, len(rows) * (r + 1) // n
        mine: list[float] = []
        with torch.no_grad(), self.state.entered():
            for b in {id(b): b for b, _ in rows[lo:hi]}.values():
                keep = [i for bb, i in rows[lo:hi] if bb is b]
                tokens, pos = b["tokens"][keep], b["position_ids"][keep]
                out = self.chunk(tokens, pos, None)[..., 0].float()
                at = last_token(b["loss_mask"][keep])
                mine += out.gather(1, at[:, None])[:, 0].tolist()
        shares: list[Any] = [None] * n
        dist.all_gather_object(shares, mine, group=group)
        return torch.tensor([s for share in shares for s in share], dtype=torch.float64)
