"""Pairwise (preference / DPO) handlers: one prompt, a chosen and a rejected answer.

MindSpeed-LLM's ``AlpacaStylePairwiseHandler`` and ``SharegptStylePairwiseHandler`` (LlamaFactory
semantics): each record becomes two sequences, the prompt followed by the chosen answer and the
same prompt followed by the rejected one, rendered and tokenized exactly as the instruction
handlers render a conversation. Every prompt token, earlier answers of the history included, is
labelled -100; only the final answer is learned.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from anyspeed.data.errors import RecordError
from anyspeed.data.handlers import (
    AlpacaHandler,
    InstructionHandler,
    Sample,
    SharegptHandler,
    check_messages,
    get_field,
    vocab_dtype,
)
from anyspeed.data.templates import Segment
from anyspeed.data.tokenizer import Tokenizer

ANSWERS = ("chosen", "rejected")


class PairwiseHandler(InstructionHandler):
    """Prompt + chosen and prompt + rejected; the prompt's tokens are the same in both."""

    keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")

    def dtypes(self, vocab_size: int) -> dict[str, type[np.integer]]:
        ids = vocab_dtype(vocab_size)
        return {k: ids if k.endswith("input_ids") else np.int32 for k in self.keys}

    def conversation(self, rec: dict) -> list[dict]:
        """The prompt as [{role, content}, ...], ending with the user turn to be answered."""
        raise NotImplementedError

    def answer(self, rec: dict, which: str) -> Any:
        """The raw ``chosen``/``rejected`` value of a record (checked by the caller)."""
        return get_field(rec, self.map.get(which))

    def process(self, records: list[dict], tok: Tokenizer) -> list[Sample | RecordError]:
        convs: list[list[Segment] | RecordError] = []
        for rec in records:
            try:
                convs += self._pair(rec, tok)
            except RecordError as exc:
                convs += [exc, exc]
        encoded = self.tokenize(convs, tok)
        results: list[Sample | RecordError] = []
        for pair in zip(encoded[0::2], encoded[1::2], strict=True):
            errors = [e for e in pair if isinstance(e, RecordError)]
            if errors:
                results.append(errors[0])
                continue
            sample: Sample = {}
            for which, enc in zip(ANSWERS, pair, strict=True):
                assert not isinstance(enc, RecordError)
                ids, labels = enc
                sample[f"{which}_input_ids"] = np.asarray(ids, dtype=np.int64)
                sample[f"{which}_labels"] = np.asarray(labels, dtype=np.int64)
            results.append(sample)
        return results

    def _pair(self, rec: dict, tok: Tokenizer) -> list[list[Segment]]:
        """Segments of prompt + chosen and prompt + rejected; all but the answer are prompt."""
        prompt = self.conversation(rec)
        if not prompt or prompt[-1]["role"] != "user":
            raise RecordError("prompt does not end with a user turn")
        pair, texts = [], []
        for which in ANSWERS:
            text = _answer_text(self.answer(rec, which), which)
            texts.append(text)
            if len(texts) == 2 and texts[0] == texts[1]:  # nothing to prefer: loss ln 2, grad 0
                raise RecordError("identical chosen and rejected answers", "nothing to prefer")
            messages = check_messages([*prompt, {"role": "assistant", "content": text}])
            segs = self.segments(messages, tok)
            pair.append([(t, False, eod) for t, _, eod in segs[:-1]] + segs[-1:])
        if pair[0][:-1] != pair[1][:-1]:
            raise RecordError("chat template is not prefix-stable", "the two prompts differ")
        return pair


def _answer_text(value: Any, which: str) -> str:
    if not isinstance(value, str):
        raise RecordError("not a string", f"{which!r} is {type(value).__name__}")
    if not value.strip():
        raise RecordError("empty answer", repr(which))
    return value


class AlpacaPairwiseHandler(PairwiseHandler, AlpacaHandler):
    """``{instruction, input, chosen, rejected[, system, history]}`` records."""

    name = "AlpacaStylePairwiseHandler"
    default_map = {
        "prompt": "instruction",
        "query": "input",
        "chosen": "chosen",
        "rejected": "rejected",
        "system": "system",
        "history": "history",
    }

    def conversation(self, rec: dict) -> list[dict]:
        return self.prompt(rec)


class SharegptPairwiseHandler(PairwiseHandler, SharegptHandler):
    """``{conversations: [..., user turn], chosen, rejected[, system]}``; an answer is a turn
    ``{from: gpt, value}`` or a plain string."""

    name = "SharegptStylePairwiseHandler"
    default_map = {**SharegptHandler.default_map, "chosen": "chosen", "rejected": "rejected"}

    def conversation(self, rec: dict) -> list[dict]:
        return self.messages(rec)

    def answer(self, rec: dict, which: str) -> Any:
        value = super().answer(rec, which)
        if not isinstance(value, dict):
            return value
        tags = self.map["tags"]
        role = value.get(tags["role_tag"], tags["assistant_tag"])
        if role != tags["assistant_tag"]:
            raise RecordError("not an assistant turn", f"{which!r} is from {role!r}")
        if value.get(tags["content_tag"]) is None:
            raise RecordError("missing key", f"{which!r} has no {tags['content_tag']!r}")
        return value[tags["content_tag"]]


PAIRWISE: dict[str, type[PairwiseHandler]] = {
    "AlpacaStylePairwiseHandler": AlpacaPairwiseHandler,
    "SharegptStylePairwiseHandler": SharegptPairwiseHandler,
}
