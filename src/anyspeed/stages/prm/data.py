"""The process reward model's data: step-labelled instruction files
(``anyspeed preprocess --handler-name AlpacaStyleProcessRewardHandler``) and the token ids of
``--placeholder-token`` and ``--reward-tokens``, checked against each other before start."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from anyspeed.errors import UsageError

if TYPE_CHECKING:
    from anyspeed.stages.common.instruction_data import InstructionData

IGNORE = -100


@dataclass(frozen=True)
class StepTokens:
    """The placeholder's id and the reward tokens' ids (empty: the whole vocabulary)."""

    placeholder: int
    rewards: tuple[int, ...]


def step_tokens(args: argparse.Namespace) -> StepTokens:
    """The flags' token ids by the run's tokenizer (one token each, else one line)."""
    from anyspeed.data.process_reward import step_token_ids
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer

    if not args.tokenizer_name_or_path:
        raise UsageError(
            "--stage prm finds each step by --placeholder-token: pass --tokenizer-type "
            "PretrainedFromHF --tokenizer-name-or-path DIR (or --load an HF directory)"
        )
    tok = load_tokenizer(TokenizerSpec(name_or_path=args.tokenizer_name_or_path))
    placeholder, rewards = step_token_ids(tok, args.placeholder_token, args.reward_tokens or [])
    return StepTokens(placeholder, rewards)


def check_steps(data: InstructionData, prefix: str, seq_length: int, ids: StepTokens) -> None:
    """Every label sits on a placeholder token and is a reward token; one line naming the
    first row that breaks it (SFT data, or another placeholder or reward tokens)."""
    allowed = np.asarray(ids.rewards, dtype=np.int64)
    for row in range(len(data)):
        lab = np.asarray(data.labels[row][:seq_length], dtype=np.int64)
        at = np.flatnonzero(lab != IGNORE)
        if not len(at):
            continue
        tokens = np.asarray(data.input_ids[row][:seq_length], dtype=np.int64)
        if (tokens[at] != ids.placeholder).any():
            raise UsageError(
                f"--data-path {prefix!r} row {row}: labels sit on tokens other than "
                f"--placeholder-token (id {ids.placeholder}); preprocess with --handler-name "
                "AlpacaStyleProcessRewardHandler and the same --placeholder-token"
            )
        if len(allowed) and not np.isin(lab[at], allowed).all():
            bad = sorted(set(lab[at].tolist()) - set(ids.rewards))
            raise UsageError(
                f"--data-path {prefix!r} row {row}: label token ids {bad} are not "
                f"--reward-tokens (ids {list(ids.rewards)}); pass the tokens it was "
                "preprocessed with"
            )
