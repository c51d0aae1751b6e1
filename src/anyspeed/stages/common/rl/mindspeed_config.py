"""MindSpeed-RL's whole config file in ``--rl-config``: the model, the training and the
actor's (and critic's) sections as flags, besides its ``rl_config`` / ``generate_config`` keys.

A MindSpeed-RL config (``configs/grpo_qwen25_7b_A3.yaml``) names its model in ``defaults: -
model: [qwen25_7b]``, read from ``model/qwen25_7b.yaml`` beside it (Hydra's layout), and holds
``megatron_training`` (tokenizer, data, sequence length, ...) and ``actor_config`` (layout,
learning rate, checkpoints; it wins over ``megatron_training``). Each key is the flag of its name
(``micro_batch_size`` -> ``--micro-batch-size``; ``global_batch_size``, prompts per rollout, ->
``--rollout-batch-size``). A PPO config's ``critic_config`` gives ``--critic-load`` and
``--critic-lr``; the critic trains at the policy's layout. Keys no flag of the stage reads are
named in the file's one warning line.
"""

from __future__ import annotations

import os
from typing import Any

from anyspeed.errors import UsageError

# MindSpeed-RL's keys that name a section or configure its own workers: not flags here
RUNTIME_KEYS = frozenset({"model", "stage", "dataset_additional_keys"})
TRAINING_SECTIONS = ("megatron_training", "actor_config")
_CRITIC = {"load": "--critic-load", "lr": "--critic-lr"}
_UNSET = object()


def training_flags(
    doc: dict, path: str, actions: dict[str, Any], renames: dict[str, str]
) -> tuple[list[str], list[str]]:
    """(the flags the model file and the training sections give, the keys not read).
    ``actions``: the stage parser's flag -> argparse action; ``renames``: key -> flag where
    the flag is not the key's own name."""
    values: dict[str, tuple[str, Any]] = {}
    model = _model_section(doc, path)
    for where, section in (("model", model), *((s, doc.get(s)) for s in TRAINING_SECTIONS)):
        if section is None:
            continue
        if not isinstance(section, dict):
            raise UsageError(f"--rl-config {path!r}: {where} must be a mapping, not {section!r}")
        values.update({str(k): (where, v) for k, v in section.items()})  # later sections win
    flags, unread = [], []
    for key, (where, value) in values.items():
        if key in RUNTIME_KEYS or value is None:
            continue
        flag = renames.get(key, "--" + key.replace("_", "-"))
        got = _as_flag(flag, value, actions.get(flag))
        if got is None and value is not False:  # an unknown switch left off is anyspeed's way
            unread.append(f"{where}.{key}")
        elif got is None:
            continue
        else:
            flags += got
    critic, more = _critic(doc, path, values, actions)
    return flags + critic, unread + more


def _as_flag(flag: str, value: Any, action: Any) -> list[str] | None:
    """``flag`` with ``value`` as a command line has it; None when the parser has no such
    flag or the value does not fit it (a list for a one-value flag)."""
    if action is None:
        return None
    if isinstance(value, bool):
        return [flag] if value else []
    if isinstance(value, list):
        return [flag, *map(str, value)] if action.nargs not in (None, 0) else None
    if isinstance(value, dict):
        return None
    return [flag, str(value)]


def _critic(
    doc: dict, path: str, values: dict[str, tuple[str, Any]], actions: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """``critic_config``'s ``load`` and ``lr`` as the critic's flags; its other keys must
    agree with the policy's (the critic trains at its layout), else they are not read."""
    section = doc.get("critic_config")
    if section is None:
        return [], []
    if not isinstance(section, dict):
        raise UsageError(f"--rl-config {path!r}: critic_config must be a mapping")
    flags, unread = [], []
    for key, value in section.items():
        if key in _CRITIC and _CRITIC[key] in actions and value is not None:
            flags += [_CRITIC[key], str(value)]
        elif key not in RUNTIME_KEYS and values.get(str(key), ("", _UNSET))[1] != value:
            unread.append(f"critic_config.{key}")  # not the policy's value: not honoured
    return flags, unread


def _model_section(doc: dict, path: str) -> dict | None:
    """The mapping of the model the config names (``defaults: - model: [name]``, or
    ``megatron_training.model``), from ``model/<name>.yaml`` beside the file."""
    import yaml

    training = doc.get("megatron_training")
    name = training.get("model") if isinstance(training, dict) else None
    for item in doc.get("defaults") or []:
        if isinstance(item, dict) and "model" in item and name is None:
            listed = item["model"]
            name = listed[0] if isinstance(listed, list) and len(listed) == 1 else listed
    if name is None:
        return None
    if not isinstance(name, str):
        raise UsageError(f"--rl-config {path!r}: defaults names models {name!r}: name one")
    file = os.path.join(os.path.dirname(os.path.abspath(path)), "model", f"{name}.yaml")
    try:
        with open(file, encoding="utf-8") as f:
            model = (yaml.safe_load(f) or {}).get(name)
    except (OSError, yaml.YAMLError, AttributeError) as exc:
        raise UsageError(
            f"--rl-config {path!r}: its model {name} is read from {file}: "
            + str(exc).splitlines()[0]
        ) from None
    if not isinstance(model, dict):
        raise UsageError(f"--rl-config {path!r}: {file} holds no {name}: mapping")
    return model


def dapo_flags(doc: dict) -> tuple[list[str], set[str], list[str]]:
    """MindSpeed-RL's DAPO switches in ``rl_config`` (each ``*_enable`` with its values) as
    anyspeed's flags: (flags, the keys they consumed, the keys not honoured)."""
    rl = doc.get("rl_config")
    if not isinstance(rl, dict):
        return [], set(), []
    flags: list[str] = []
    used: set[str] = set()
    unread: list[str] = []

    def take(*keys: str) -> list:
        used.update(k for k in keys if k in rl)
        return [rl.get(k) for k in keys]

    if "token_level_loss" in rl:
        (token,) = take("token_level_loss")
        flags += ["--loss-agg-mode", "token-mean" if token else "seq-mean-token-mean"]
    if "clip_higher_enable" in rl:
        on, low, high = take("clip_higher_enable", "clip_ratio_low", "clip_ratio_high")
        if on:
            flags += ["--clip-ratio", str(low if low is not None else rl.get("clip_ratio", 0.2))]
            flags += ["--clip-ratio-high", str(high)] if high is not None else []
    if "overlong_buffer_enable" in rl:
        on, size, factor, most = take(
            "overlong_buffer_enable",
            "overlong_buffer",
            "overlong_buffer_penalty_factor",
            "rollout_max_tokens",
        )
        if on:
            flags += ["--overlong-buffer-len", str(size or 0)]
            flags += ["--overlong-penalty-factor", str(factor)] if factor is not None else []
        flags += ["--max-response-length", str(most)] if most is not None else []
    if "filter_groups_enable" in rl:
        on, _, most, _ = take(
            "filter_groups_enable",
            "filter_groups_metric",
            "filter_groups_max_batches",
            "filter_groups_train_batch_size",
        )
        flags += ["--filter-groups"] if on else []
        if on and isinstance(most, int) and most > 0:
            flags += ["--max-num-gen-batches", str(most)]
        elif on and most is not None:  # -1: unbounded there; here --max-num-gen-batches stops
            unread.append("rl_config.filter_groups_max_batches")
    if rl.get("kl_ctrl_type", "fixed") == "fixed":
        take("kl_ctrl_type")  # a fixed KL coefficient is the only kind here
    if rl.get("rule_reward", True) is True:
        take("rule_reward")  # rule rewards are --verifier-function's
    return flags, used, unread
