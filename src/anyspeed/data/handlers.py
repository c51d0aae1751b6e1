"""Record handlers: pretraining text and alpaca/sharegpt/OpenAI instruction data to token arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from anyspeed.data.errors import RecordError, UsageError
from anyspeed.data.templates import TEMPLATES, Segment
from anyspeed.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
Sample = dict[str, np.ndarray]


def vocab_dtype(vocab_size: int) -> type[np.integer]:
    """Smallest dtype that holds every token id (the same rule Megatron uses)."""
    return np.uint16 if vocab_size < 65500 else np.int32


class Handler:
    """Turns a batch of records into samples (key -> 1-D array) or RecordErrors."""

    name = ""
    instruction = False
    keys: tuple[str, ...] = ()

    def columns(self) -> list[str] | None:
        """Top-level columns a columnar reader needs (None: all)."""
        return None

    def dtypes(self, vocab_size: int) -> dict[str, type[np.integer]]:
        """On-disk dtype of each output key."""
        return {k: vocab_dtype(vocab_size) for k in self.keys}

    def process(self, records: list[dict], tok: Tokenizer) -> list[Sample | RecordError]:
        """Tokenize a batch of records; one result per record, in order."""
        raise NotImplementedError


class PretrainHandler(Handler):
    """Plain documents under ``--json-keys``; each key becomes its own dataset."""

    name = "GeneralPretrainHandler"

    def __init__(self, json_keys: list[str], append_eod: bool, eod_id: int | None) -> None:
        self.keys = tuple(json_keys)
        self.append_eod = append_eod
        self.eod_id = eod_id

    def columns(self) -> list[str] | None:
        return list(self.keys)

    def process(self, records: list[dict], tok: Tokenizer) -> list[Sample | RecordError]:
        results: list[Sample | RecordError] = []
        texts: list[str] = []
        for rec in records:
            try:
                texts.extend(_text(rec, k) for k in self.keys)
                results.append({})
            except RecordError as exc:
                results.append(exc)
        ids = iter(tok.encode(texts, special=True)) if texts else iter(())
        for sample in results:
            if isinstance(sample, RecordError):
                continue
            for key in self.keys:
                toks = next(ids)
                if self.append_eod:
                    toks = [*toks, self.eod_id]
                sample[key] = np.asarray(toks, dtype=np.int64)
        return results


def _text(rec: dict, key: str) -> str:
    """The non-empty string under ``key`` or a RecordError saying why not."""
    if key not in rec or rec[key] is None:
        raise RecordError("missing key", repr(key))
    value = rec[key]
    if not isinstance(value, str):
        raise RecordError("not a string", f"{key!r} is {type(value).__name__}")
    if not value.strip():
        raise RecordError("empty document", repr(key))
    return value


class InstructionHandler(Handler):
    """Conversations rendered by a chat template; prompt tokens get label -100."""

    instruction = True
    keys = ("input_ids", "attention_mask", "labels")
    default_map: dict[str, Any] = {}

    def __init__(
        self,
        tok: Tokenizer,
        map_keys: dict[str, Any] | None = None,
        prompt_type: str | None = None,
        append_eod: bool = False,
        seq_length: int | None = None,
    ) -> None:
        check_map_keys(map_keys or {}, self.default_map, getattr(self, "name", type(self).__name__))
        self.map = {**self.default_map, **(map_keys or {})}
        if "tags" in self.default_map:
            self.map["tags"] = {**self.default_map["tags"], **(map_keys or {}).get("tags", {})}
        if prompt_type is not None and prompt_type not in TEMPLATES:
            names = ", ".join(sorted(TEMPLATES))
            raise UsageError(f"unknown --prompt-type {prompt_type!r}; choose from {names}")
        if prompt_type is None and not tok.has_chat_template:
            raise UsageError(
                f"tokenizer {tok.name!r} has no chat template; pass --prompt-type "
                f"({', '.join(sorted(TEMPLATES))})"
            )
        if (append_eod or (prompt_type and TEMPLATES[prompt_type].eod_after_response)) and (
            tok.eod_id is None
        ):
            raise UsageError("the tokenizer has no end-of-document token (needed for EOD)")
        self.prompt_type = prompt_type
        self.append_eod = append_eod
        self.seq_length = seq_length
        self.eod_id = tok.eod_id

    def dtypes(self, vocab_size: int) -> dict[str, type[np.integer]]:
        return {
            "input_ids": vocab_dtype(vocab_size),
            "attention_mask": np.uint8,
            "labels": np.int32,
        }

    def messages(self, rec: dict) -> list[dict]:
        """The record as [{role, content}, ...] ending with an assistant turn."""
        raise NotImplementedError

    def tools(self, rec: dict, messages: list[dict]) -> list[dict] | None:
        """The record's tools (``--map-keys`` ``tools``); tools and tool turns need the
        tokenizer's chat template (a ``--prompt-type`` template renders neither)."""
        key = self.map.get("tools")
        tools = record_tools(get_field(rec, key, required=False), str(key)) if key else None
        turns = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if (tools or turns) and self.prompt_type is not None:
            raise UsageError(
                "records with tools or tool turns need the tokenizer's chat template to render "
                f"them; drop --prompt-type {self.prompt_type}"
            )
        return tools

    def segments(
        self, messages: list[dict], tok: Tokenizer, tools: list | None = None
    ) -> list[Segment]:
        """Prompt/response text pieces of a conversation, in order (``tools``: JSON schemas
        the tokenizer's chat template shows the model)."""
        if self.prompt_type is not None:
            return TEMPLATES[self.prompt_type].segments(messages)
        out: list[Segment] = []
        done = ""
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prompt = tok.render_chat(messages[:i], add_generation_prompt=True, tools=tools)
            full = tok.render_chat(messages[: i + 1], add_generation_prompt=False, tools=tools)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise RecordError("chat template is not prefix-stable", f"turn {i}")
            out.append((prompt[len(done) :], False, False))
            out.append((full[len(prompt) :], True, False))
            done = full
        return [s for s in out if s[0] or s[1]]

    def process(self, records: list[dict], tok: Tokenizer) -> list[Sample | RecordError]:
        convs: list[list[Segment] | RecordError] = []
        for rec in records:
            try:
                messages = check_messages(self.messages(rec))
                convs.append(self.segments(messages, tok, self.tools(rec, messages)))
            except RecordError as exc:
                convs.append(exc)
        results: list[Sample | RecordError] = []
        for enc in self.tokenize(convs, tok):
            if isinstance(enc, RecordError):
                results.append(enc)
                continue
            input_ids, labels = enc
            results.append(
                {
                    "input_ids": np.asarray(input_ids, dtype=np.int64),
                    "attention_mask": np.ones(len(input_ids), dtype=np.int64),
                    "labels": np.asarray(labels, dtype=np.int64),
                }
            )
        return results

    def tokenize(
        self, convs: list[list[Segment] | RecordError], tok: Tokenizer
    ) -> list[tuple[list[int], list[int]] | RecordError]:
        """(input_ids, labels) of each segment list, encoded in one batch; a sample over
        ``--seq-length`` becomes a RecordError (errors pass through)."""
        texts = [s[0] for segs in convs if not isinstance(segs, RecordError) for s in segs]
        ids = iter(tok.encode(texts, special=False)) if texts else iter(())
        out: list[tuple[list[int], list[int]] | RecordError] = []
        for segs in convs:
            if isinstance(segs, RecordError):
                out.append(segs)
                continue
            input_ids: list[int] = []
            labels: list[int] = []
            for _, is_response, eod in segs:
                toks = next(ids) + ([self.eod_id] if eod else [])
                input_ids += toks
                labels += toks if is_response else [IGNORE_INDEX] * len(toks)
            if self.append_eod:
                input_ids.append(self.eod_id)  # type: ignore[arg-type]
                labels.append(self.eod_id)  # type: ignore[arg-type]
            if self.seq_length is not None and len(input_ids) > self.seq_length:
                out.append(
                    RecordError("longer than --seq-length", f"{len(input_ids)} > {self.seq_length}")
                )
                continue
            out.append((input_ids, labels))
        return out


def check_map_keys(given: dict[str, Any], default: dict[str, Any], handler: str) -> None:
    """``--map-keys`` names only what ``handler`` reads, each a record field (a string), and
    ``tags`` only known tags; one UsageError line naming the name and the known ones."""
    for key, value in given.items():
        known = default.get("tags", {}) if key == "tags" else None
        if key not in default:
            raise UsageError(
                f"--map-keys: {handler} reads no {key!r}; it reads {', '.join(sorted(default))}"
            )
        if known is not None and not isinstance(value, dict):
            raise UsageError(f"--map-keys: 'tags' must be an object of {', '.join(sorted(known))}")
        if known is not None:
            check_map_keys(value, known, f"{handler}'s tags")
        elif not isinstance(value, str):
            raise UsageError(
                f"--map-keys: {key!r} must name a record field (a string), not {value!r}"
            )


def check_messages(messages: list[dict]) -> list[dict]:
    """Validate roles/contents and drop trailing turns that have no response to learn. A tool
    turn (role ``tool``) and an assistant turn that calls tools (``tool_calls``, its content
    possibly empty) are kept for the chat template to render."""
    for msg in messages:
        if msg["role"] not in ("system", "user", "assistant", "tool"):
            raise RecordError("unknown role", repr(msg["role"]))
        if msg.get("tool_calls") is not None:
            if msg["role"] != "assistant" or not isinstance(msg["tool_calls"], list):
                raise RecordError("bad tool_calls", "a list, on an assistant turn")
            msg["content"] = msg["content"] or ""
        if not isinstance(msg["content"], str):
            raise RecordError("not a string", f"{msg['role']} content")
    while messages and messages[-1]["role"] != "assistant":
        messages = messages[:-1]
    if not messages:
        raise RecordError("no assistant response")
    said = [
        m["content"].strip() or m.get("tool_calls") for m in messages if m["role"] == "assistant"
    ]
    if not any(said):
        raise RecordError("empty document", "empty response")
    return messages


def record_tools(value: Any, key: str) -> list[dict] | None:
    """A record's tools: a list of JSON schemas (``{"type": "function", "function": {"name":
    ..., "parameters": ...}}`` or the bare function object), or a JSON string of one; a
    RecordError saying what is wrong otherwise (TRL's and the chat template's layout)."""
    import json

    if value is None or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RecordError("tools is not JSON", repr(key)) from None
    if not isinstance(value, list):
        raise RecordError("tools must be a list", f"{key!r} is {type(value).__name__}")
    out = []
    for t in value:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RecordError("a tool must be a JSON schema with a name", repr(t)[:60])
        out.append({"type": "function", "function": fn})
    return out


def get_field(rec: dict, key: str | None, required: bool = True) -> Any:
    """Record field ``key``: a RecordError when required and missing, else None."""
    if key is None or rec.get(key) is None:
        if required:
            raise RecordError("missing key", repr(key))
        return None
    return rec[key]


class AlpacaHandler(InstructionHandler):
    """``{instruction, input, output[, system, history]}`` records."""

    name = "AlpacaStyleInstructionHandler"
    default_map = {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
    }

    def messages(self, rec: dict) -> list[dict]:
        prompt = self.prompt(rec)
        return prompt + [{"role": "assistant", "content": get_field(rec, self.map["response"])}]

    def prompt(self, rec: dict) -> list[dict]:
        """System, history turns and the final user turn (instruction + input)."""
        m = self.map
        prompt = get_field(rec, m["prompt"])
        query = get_field(rec, m.get("query"), required=False)
        system = get_field(rec, m.get("system"), required=False)
        history = get_field(rec, m.get("history"), required=False) or []
        out = [{"role": "system", "content": system}] if system else []
        try:
            for q, a in history:
                out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        except (TypeError, ValueError):
            raise RecordError("bad history", "expected [[query, response], ...]") from None
        user = f"{prompt}\n{query}" if isinstance(query, str) and query else prompt
        return out + [{"role": "user", "content": user}]


class SharegptHandler(InstructionHandler):
    """``{conversations: [{from, value}, ...][, system]}`` records (tags set by --map-keys)."""

    name = "SharegptStyleInstructionHandler"
    default_map = {
        "messages": "conversations",
        "system": "system",
        "tools": "tools",
        "tags": {
            "role_tag": "from",
            "content_tag": "value",
            "user_tag": "human",
            "assistant_tag": "gpt",
            "system_tag": "system",
        },
    }

    def messages(self, rec: dict) -> list[dict]:
        tags = self.map["tags"]
        roles = {
            tags["user_tag"]: "user",
            tags["assistant_tag"]: "assistant",
            tags["system_tag"]: "system",
        }
        turns = get_field(rec, self.map["messages"])
        if not isinstance(turns, list):
            raise RecordError("bad messages", "expected a list")
        out = []
        system = get_field(rec, self.map.get("system"), required=False)
        if system:
            out.append({"role": "system", "content": system})
        for turn in turns:
            if not isinstance(turn, dict) or tags["role_tag"] not in turn:
                raise RecordError("missing key", repr(tags["role_tag"]))
            role = turn[tags["role_tag"]]
            msg = {"role": roles.get(role, role), "content": turn.get(tags["content_tag"])}
            msg.update({k: turn[k] for k in ("tool_calls", "name") if k in turn})
            out.append(msg)
        return out


class OpenAIHandler(SharegptHandler):
    """``{messages: [{role, content}, ...]}`` records (OpenAI chat layout)."""

    name = "OpenAIStyleInstructionHandler"
    default_map = {
        "messages": "messages",
        "system": "system",
        "tools": "tools",
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
            "system_tag": "system",
        },
    }
