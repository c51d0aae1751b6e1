"""Step-labelled data for a process reward model: MindSpeed-LLM's
``AlpacaStyleProcessRewardHandler`` (Math-Shepherd's layout, as OpenRLHF reads it too).

A record is ``{"input": text, "value": [label, ...]}``: the text marks the end of each reasoning
step with ``--placeholder-token`` (default ``ки``), and ``value`` holds one label per step, a
``--reward-tokens`` string (``"+"``/``"-"``) or a boolean (true: the first reward token, false:
the second). TRL's stepwise-supervision records, ``{"prompt", "completions": [step, ...],
"labels": [bool, ...]}``, read as ``prompt\nstep ки\nstep ки``. The whole text is tokenized as
it is (no chat template, no special tokens), so a model scores it the way the same tokenizer
reads it anywhere. The files are the instruction
data's (``<prefix>_packed_{input_ids,attention_mask,labels}_document``): ``labels`` is -100
except at each placeholder, where it holds that step's label token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from anyspeed.data.errors import RecordError, UsageError
from anyspeed.data.handlers import (
    IGNORE_INDEX,
    InstructionHandler,
    Sample,
    check_map_keys,
    get_field,
)
from anyspeed.data.tokenizer import Tokenizer

PLACEHOLDER = "ки"  # Math-Shepherd's step tag, MindSpeed-LLM's default


def single_token(tok: Tokenizer, text: str, flag: str) -> int:
    """The one id ``text`` encodes to (no special tokens); a UsageError naming ``flag``
    otherwise."""
    ids = tok.encode([text], special=False)[0]
    if len(ids) != 1:
        raise UsageError(
            f"{flag} {text!r} is {len(ids)} tokens for tokenizer {tok.name!r}, not one: "
            "choose a string the tokenizer keeps as one token (e.g. an added special token)"
        )
    return ids[0]


def step_token_ids(
    tok: Tokenizer, placeholder: str, rewards: list[str], prefix: str = ""
) -> tuple[int, tuple[int, ...]]:
    """(the placeholder's id, each reward token's id): one token each, the reward tokens
    distinct and none the placeholder; a UsageError naming ``--{prefix}placeholder-token`` or
    ``--{prefix}reward-tokens`` otherwise."""
    ph_flag, rw_flag = f"--{prefix}placeholder-token", f"--{prefix}reward-tokens"
    ph = single_token(tok, placeholder, ph_flag)
    ids = tuple(single_token(tok, t, rw_flag) for t in rewards)
    if len(set(ids)) != len(ids) or ph in ids:
        raise UsageError(f"{rw_flag} must be distinct, and differ from {ph_flag}")
    return ph, ids


class ProcessRewardHandler(InstructionHandler):
    """Texts with a placeholder token after every step, and one label per placeholder."""

    name = "AlpacaStyleProcessRewardHandler"
    default_map = {
        "input": "input",
        "value": "value",
        "prompt": "prompt",  # TRL's stepwise supervision
        "completions": "completions",
        "labels": "labels",
    }

    def __init__(
        self,
        tok: Tokenizer,
        map_keys: dict[str, Any] | None = None,
        placeholder: str | None = None,
        reward_tokens: list[str] | None = None,
        seq_length: int | None = None,
    ) -> None:
        check_map_keys(map_keys or {}, self.default_map, self.name)
        self.map = {**self.default_map, **(map_keys or {})}
        self.placeholder = PLACEHOLDER if placeholder is None else placeholder
        self.reward_tokens = list(reward_tokens or [])
        self.placeholder_id, ids = step_token_ids(tok, self.placeholder, self.reward_tokens)
        self.reward_ids = dict(zip(self.reward_tokens, ids, strict=True))
        self.seq_length = seq_length
        self.append_eod = False
        self.prompt_type = None
        self.eod_id = tok.eod_id
        self._free: dict[str, int] = {}  # label strings without --reward-tokens, encoded once

    def process(self, records: list[dict], tok: Tokenizer) -> list[Sample | RecordError]:
        texts: list[str | RecordError] = []
        for rec in records:
            try:
                texts.append(self._text(rec))
            except RecordError as exc:
                texts.append(exc)
        good = [t for t in texts if isinstance(t, str)]
        ids = iter(tok.encode(good, special=False)) if good else iter(())
        out: list[Sample | RecordError] = []
        for rec, text in zip(records, texts, strict=True):
            if isinstance(text, RecordError):
                out.append(text)
                continue
            try:
                out.append(self._sample(next(ids), text, rec, tok))
            except RecordError as exc:
                out.append(exc)
        return out

    def _text(self, rec: dict) -> str:
        key = self.map["input"]
        if key not in rec and self.map["completions"] in rec:
            return self._stepwise(rec)
        text = get_field(rec, key)
        if not isinstance(text, str):
            raise RecordError("not a string", f"{key!r} is {type(text).__name__}")
        if self.placeholder not in text:
            raise RecordError(
                "no step", f"{key!r} holds no --placeholder-token {self.placeholder!r}"
            )
        return text

    def _stepwise(self, rec: dict) -> str:
        """TRL's record as one text: the prompt, then each step (the placeholder's own text
        taken out) followed by a space and the placeholder, a newline before each."""
        prompt, key = get_field(rec, self.map["prompt"]), self.map["completions"]
        steps = get_field(rec, key)
        if not isinstance(prompt, str) or not isinstance(steps, list):
            raise RecordError("not a stepwise record", f"{key!r} must be a list of strings")
        if not steps or not all(isinstance(x, str) for x in steps):
            raise RecordError("no step", f"{key!r} holds no list of strings")
        ph = self.placeholder
        return "\n".join([prompt, *(f"{x.replace(ph, '')} {ph}" for x in steps)])

    def _sample(self, ids: list[int], text: str, rec: dict, tok: Tokenizer) -> Sample:
        if self.seq_length is not None and len(ids) > self.seq_length:
            raise RecordError("longer than --seq-length", f"{len(ids)} > {self.seq_length}")
        steps = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        labels = self._labels(rec, tok)
        if len(steps) != len(labels):
            written = text.count(self.placeholder)
            merged = (
                f"; the text has {written}, so the tokenizer merges the placeholder with its "
                "neighbours: use a placeholder it keeps whole"
                if written != len(steps)
                else ""
            )
            raise RecordError(
                "steps and labels differ",
                f"{len(steps)} placeholder tokens, {len(labels)} labels{merged}",
            )
        lab = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        lab[steps] = labels
        return {
            "input_ids": np.asarray(ids, dtype=np.int64),
            "attention_mask": np.ones(len(ids), dtype=np.int64),
            "labels": lab,
        }

    def _labels(self, rec: dict, tok: Tokenizer) -> list[int]:
        """The record's step labels as token ids (a RecordError names a bad one)."""
        key = self.map["value"] if self.map["value"] in rec else self.map["labels"]
        values = get_field(rec, key)
        if not isinstance(values, list):
            raise RecordError("labels not a list", f"{key!r} is {type(values).__name__}")
        return [self._label(v, key, tok) for v in values]

    def _label(self, value: Any, key: str, tok: Tokenizer) -> int:
        if isinstance(value, bool):
            if len(self.reward_tokens) < 2:
                raise RecordError(
                    "boolean label", f"{key!r}: true/false need two --reward-tokens (good, bad)"
                )
            return self.reward_ids[self.reward_tokens[0 if value else 1]]
        if not isinstance(value, str):
            raise RecordError("bad label", f"{key!r} holds {value!r}")
        if self.reward_tokens:
            if value not in self.reward_ids:
                raise RecordError("bad label", f"{value!r} is not one of --reward-tokens")
            return self.reward_ids[value]
        if value not in self._free:
            ids = tok.encode([value], special=False)[0]
            if len(ids) != 1:
                raise RecordError("bad label", f"{value!r} is {len(ids)} tokens, not one")
            self._free[value] = ids[0]
        return self._free[value]


PRM: dict[str, type[ProcessRewardHandler]] = {
    "AlpacaStyleProcessRewardHandler": ProcessRewardHandler
}
