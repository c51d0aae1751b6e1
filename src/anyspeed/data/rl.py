"""Prompts for reinforcement learning (GRPO): MindSpeed-RL's ``R1AlpacaStyleInstructionHandler``.

Each alpaca record becomes its prompt, rendered and tokenized exactly as the instruction handler
renders the same conversation up to the final answer (the assistant header that opens the answer
included, earlier turns and their answers too), and the reference answer's own tokens, kept for
the verifier. The files are the instruction data's (``<prefix>_packed_{input_ids,attention_mask,
labels}_document``, MindSpeed-RL's layout), but ``labels`` holds the answer, not a shifted copy
of ``input_ids``: its length differs and no token is -100.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from anyspeed.data.errors import RecordError, UsageError
from anyspeed.data.handlers import AlpacaHandler, Sample, check_messages, get_field
from anyspeed.data.templates import Segment
from anyspeed.data.tokenizer import Tokenizer


class R1AlpacaHandler(AlpacaHandler):
    """``{instruction, input, output[, system, history, tools]}`` records (``--map-keys`` names
    ``prompt``, ``query``, ``response``, ``system``, ``history``, ``tools``) to prompt + answer
    tokens. ``tools`` (TRL's and the chat template's layout): the JSON schemas of the tools the
    model may call, rendered by the tokenizer's chat template."""

    name = "R1AlpacaStyleInstructionHandler"
    default_map = {**AlpacaHandler.default_map, "tools": "tools"}

    def __init__(
        self,
        tok: Tokenizer,
        map_keys: dict[str, Any] | None = None,
        prompt_type: str | None = None,
        append_eod: bool = False,
        seq_length: int | None = None,
    ) -> None:
        if append_eod:
            raise UsageError(
                f"--append-eod does not apply to {self.name}: a prompt ends where the answer starts"
            )
        super().__init__(tok, map_keys, prompt_type, False, seq_length)

    def process(self, records: list[dict], tok: Tokenizer) -> list[Sample | RecordError]:
        prompts: list[list[Segment] | RecordError] = []
        answers: list[str | None] = []  # None where the record is already an error
        for rec in records:
            try:
                answer = _answer(get_field(rec, self.map.get("response")), self.map.get("response"))
                prompts.append(self._prompt(rec, answer, tok))
                answers.append(answer)
            except RecordError as exc:
                prompts.append(exc)
                answers.append(None)
        # The prompts alone: --seq-length bounds the prompt, and no EOD is appended.
        encoded = self.tokenize(prompts, tok)
        texts = [a for a in answers if a is not None]
        answer_ids = iter(tok.encode(texts, special=False)) if texts else iter(())
        results: list[Sample | RecordError] = []
        for enc, answer in zip(encoded, answers, strict=True):
            labels = next(answer_ids) if answer is not None else None
            if isinstance(enc, RecordError):
                results.append(enc)
                continue
            input_ids = enc[0]
            results.append(
                {
                    "input_ids": np.asarray(input_ids, dtype=np.int64),
                    "attention_mask": np.ones(len(input_ids), dtype=np.int64),
                    "labels": np.asarray(labels, dtype=np.int64),
                }
            )
        return results

    def _prompt(self, rec: dict, answer: str, tok: Tokenizer) -> list[Segment]:
        """The segments of the conversation before its final answer, all of them prompt."""
        messages = check_messages([*self.prompt(rec), {"role": "assistant", "content": answer}])
        if not messages[-2]["content"].strip():  # the user turn the answer answers
            raise RecordError("empty prompt", repr(self.map.get("prompt")))
        segs = self.segments(messages, tok, self.tools(rec, messages))
        return [(text, False, eod) for text, _, eod in segs[:-1]]


def _answer(value: Any, key: str | None) -> str:
    """The reference answer: a non-empty string, else a RecordError saying why not."""
    if not isinstance(value, str):
        raise RecordError("not a string", f"{key!r} is {type(value).__name__}")
    if not value.strip():
        raise RecordError("empty answer", repr(key))
    return value


RL: dict[str, type[R1AlpacaHandler]] = {"R1AlpacaStyleInstructionHandler": R1AlpacaHandler}
