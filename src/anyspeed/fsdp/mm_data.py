"""Multimodal conversations for ``anyspeed fsdp2``: a JSON (or JSON-lines) file of records in
LLaMA-Factory's / MindSpeed-MM's ``mllm`` layout, ``{"messages": [{"role": "user", "content":
"<image>What is drawn?"}, {"role": "assistant", "content": "..."}], "images": ["a.png"]}``
(LLaVA's ``conversations`` / ``from`` / ``value`` / ``image`` is read too).

The model directory's own chat template renders the turns and its own image processor makes
the pixels; each image's placeholder becomes as many image tokens as the tower yields for it
(Qwen2-VL's rule: the patch grid over the merge size squared). The loss is on the assistant's
turns (their text and end marker). Every record is checked when the file is opened: a bad
one is a one-line error naming the file and the record.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.fsdp.samples import IGNORE, Sample

TAG = "<image>"
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
# model_type -> the image placeholder token the chat template writes (Qwen2-VL's rule: it
# becomes grid / merge_size**2 image tokens)
FAMILIES = {"qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>", "qwen3_vl": "<|image_pad|>"}


def _image_processor(auto: Any, model_dir: str) -> Any:
    """The model's image processor; where ``AutoImageProcessor`` needs torchvision and it is
    absent (transformers 5.17; 5.25 falls back by itself), the PIL one, same settings."""
    try:
        return auto.from_pretrained(model_dir)
    except ImportError as exc:
        import transformers

        pil = getattr(transformers, "Qwen2VLImageProcessorPil", None)
        torchvision = "torchvision" in str(exc).lower()
        if torchvision and pil is not None:
            return pil.from_pretrained(model_dir)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(
            f"model.model_name_or_path {model_dir!r}: transformers {transformers.__version__} "
            f"cannot load its image processor ({first}); "
            + ("pip install torchvision" if torchvision else "install the module it names")
        ) from None


def _records(path: str) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except ValueError:
        pass
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                raise UsageError(f"data.dataset {path!r} line {n} is not JSON") from None
    return out


def _normalise(record: Any) -> tuple[list[dict[str, str]], list[str]]:
    """(messages with role/content, image files) of an mllm or LLaVA record; ValueError."""
    if not isinstance(record, dict):
        raise ValueError("is not a JSON object")
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise ValueError("has no 'messages' list")
    messages = []
    for t in turns:
        role = ROLES.get(str(t.get("role", t.get("from", ""))))
        content = t.get("content", t.get("value"))
        if role is None or not isinstance(content, str):
            raise ValueError("has a turn without a known role and a text content")
        messages.append({"role": role, "content": content})
    images = record.get("images", [record["image"]] if record.get("image") else [])
    if record.get("videos"):
        raise ValueError("has videos, which anyspeed fsdp2 does not read yet")
    if not isinstance(images, list):
        raise ValueError("'images' is not a list")
    return messages, [str(i) for i in images]


class ConversationSource:
    """The checked records of a conversation file, rendered and tokenized on demand."""

    def __init__(self, path: str, seq: int, model_dir: str, image_dir: str, max_pixels: int):
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        from anyspeed.fsdp.model import quiet
        from anyspeed.stages.vlm.data import image_problem

        config = AutoConfig.from_pretrained(model_dir)
        if config.model_type not in FAMILIES:
            raise UsageError(
                f"data.dataset {path!r} is a conversation file: anyspeed fsdp2 reads images for "
                f"{', '.join(FAMILIES)} models, not {config.model_type!r}"
            )
        with quiet():  # e.g. "requires torchvision, falling back to the PIL processor"
            self.tok = AutoTokenizer.from_pretrained(model_dir)
            self.images = _image_processor(AutoImageProcessor, model_dir)
        if not self.tok.chat_template:
            raise UsageError(f"model.model_name_or_path {model_dir!r} has no chat template")
        self.pad = FAMILIES[config.model_type]
        self.pad_id = self.tok.convert_tokens_to_ids(self.pad)
        self.seq, self.path = seq, path
        folder = image_dir or os.path.dirname(os.path.abspath(path))
        self.items = []
        for n, record in enumerate(_records(path)):
            where = f"data.dataset {path!r} record {n}"
            try:
                messages, images = _normalise(record)
            except ValueError as exc:
                raise UsageError(f"{where} {exc}") from None
            tags = sum(m["content"].count(TAG) for m in messages)
            if tags != len(images):
                raise UsageError(f"{where} has {tags} {TAG} tags for {len(images)} images")
            files = [os.path.join(folder, i) for i in images]
            for f in files:
                why = image_problem(f, max_pixels)
                if why is not None:
                    raise UsageError(f"{where}: image {f!r} {why[1]}")
            self.items.append((messages, files))

    def __len__(self) -> int:
        return len(self.items)

    def _template(self, messages: list[dict[str, str]], prompt: bool) -> str:
        chat = [{"role": m["role"], "content": _content(m["content"])} for m in messages]
        return self.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)

    def _expand(self, text: str, counts: list[int]) -> str:
        parts = text.split(self.pad)
        out = parts[0]
        for i, part in enumerate(parts[1:]):
            out += self.pad * (counts[i] if i < len(counts) else 1) + part
        return out

    def __getitem__(self, i: int) -> Sample:
        from PIL import Image

        messages, files = self.items[i]
        extra: dict[str, torch.Tensor] = {}
        counts: list[int] = []
        if files:
            pics = []
            for f in files:
                with Image.open(f) as im:
                    pics.append(im.convert("RGB"))
            out = self.images(images=pics, return_tensors="pt")
            extra = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            merge = int(getattr(self.images, "merge_size", 2)) ** 2
            counts = [int(g.prod()) // merge for g in out["image_grid_thw"]]
        text = self._expand(self._template(messages, False), counts)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        learn = [False] * len(ids)
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self._expand(self._template(messages[:k], True), counts))
            end = len(self._expand(self._template(messages[: k + 1], False), counts))
            for j, (a, _) in enumerate(offsets):
                if start <= a < end:
                    learn[j] = True
        if len(ids) > self.seq and self.pad_id in ids[self.seq :]:
            raise UsageError(
                f"data.dataset {self.path!r} record {i}: its image tokens reach past "
                f"data.cutoff_len {self.seq}; raise it or lower the image size"
            )
        ids, learn = ids[: self.seq + 1], learn[: self.seq + 1]
        targets = [t if ok else IGNORE for t, ok in zip(ids[1:], learn[1:], strict=True)]
        types = [1 if t == self.pad_id else 0 for t in ids[:-1]]
        return Sample(ids[:-1], targets, extra, {"mm_token_type_ids": types})


def _content(text: str) -> list[dict[str, str]]:
    """A message's text with its ``<image>`` tags as the chat template's image items."""
    items: list[dict[str, str]] = []
    for k, piece in enumerate(text.split(TAG)):
        if k:
            items.append({"type": "image"})
        if piece:
            items.append({"type": "text", "text": piece})
    return items
