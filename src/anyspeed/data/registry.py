"""The preprocessing handlers by ``--handler-name`` (MindSpeed-LLM's names): pretraining,
instruction, preference (pairwise), step-labelled (process reward) and RL-prompt handlers, and
the checks of their flags."""

from __future__ import annotations

import json

from anyspeed.data.errors import UsageError
from anyspeed.data.handlers import (
    AlpacaHandler,
    Handler,
    OpenAIHandler,
    PretrainHandler,
    SharegptHandler,
)
from anyspeed.data.tokenizer import Tokenizer

HANDLERS: dict[str, type[Handler]] = {
    "GeneralPretrainHandler": PretrainHandler,
    "AlpacaStyleInstructionHandler": AlpacaHandler,
    "SharegptStyleInstructionHandler": SharegptHandler,
    "OpenAIStyleInstructionHandler": OpenAIHandler,
    "OpenAIInstructionHandler": OpenAIHandler,
}
# Preference (DPO) handlers live in anyspeed.data.pairwise; it is imported when one is named.
PAIRWISE_HANDLERS = ("AlpacaStylePairwiseHandler", "SharegptStylePairwiseHandler")
# Prompts for reinforcement learning (GRPO) likewise live in anyspeed.data.rl.
RL_HANDLERS = ("R1AlpacaStyleInstructionHandler",)
# Step-labelled data for a process reward model: anyspeed.data.process_reward.
PRM_HANDLERS = ("AlpacaStyleProcessRewardHandler",)
HANDLER_NAMES = (*HANDLERS, *PAIRWISE_HANDLERS, *RL_HANDLERS, *PRM_HANDLERS)


def handler_class(name: str) -> type[Handler]:
    """The class ``--handler-name`` names (UsageError for an unknown name)."""
    if name in PAIRWISE_HANDLERS:
        from anyspeed.data.pairwise import PAIRWISE

        return PAIRWISE[name]
    if name in RL_HANDLERS:
        from anyspeed.data.rl import RL

        return RL[name]
    if name in PRM_HANDLERS:
        from anyspeed.data.process_reward import PRM

        return PRM[name]
    cls = HANDLERS.get(name)
    if cls is None:
        raise UsageError(f"unknown --handler-name {name!r}; choose from {', '.join(HANDLER_NAMES)}")
    return cls


def build_handler(
    name: str,
    tok: Tokenizer,
    json_keys: list[str],
    append_eod: bool,
    map_keys: str | None = None,
    prompt_type: str | None = None,
    seq_length: int | None = None,
    placeholder_token: str | None = None,
    reward_tokens: list[str] | None = None,
) -> Handler:
    """Construct the handler ``--handler-name`` names, validating its flags (UsageError)."""
    cls = handler_class(name)
    step_labelled = name in PRM_HANDLERS
    if not step_labelled and (placeholder_token is not None or reward_tokens):
        raise UsageError(
            f"--placeholder-token/--reward-tokens apply to {PRM_HANDLERS[0]}, not {name}"
        )
    if cls is PretrainHandler:
        if append_eod and tok.eod_id is None:
            raise UsageError("--append-eod: the tokenizer has no end-of-document token")
        if prompt_type is not None or map_keys is not None:
            raise UsageError(f"--prompt-type/--map-keys do not apply to {name}")
        return PretrainHandler(json_keys, append_eod, tok.eod_id)
    try:
        mapping = json.loads(map_keys) if map_keys else None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--map-keys is not valid JSON: {exc.msg}") from None
    if mapping is not None and not isinstance(mapping, dict):
        raise UsageError("--map-keys must be a JSON object")
    if step_labelled:
        from anyspeed.data.process_reward import ProcessRewardHandler

        if prompt_type is not None or append_eod:
            raise UsageError(
                f"--prompt-type/--append-eod do not apply to {name}: the text is scored as written"
            )
        return ProcessRewardHandler(tok, mapping, placeholder_token, reward_tokens, seq_length)
    return cls(tok, mapping, prompt_type, append_eod, seq_length)  # type: ignore[call-arg]
