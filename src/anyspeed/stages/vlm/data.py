"""Image-text data of the ``vlm`` stage: LLaVA's conversation jsonl and its image files.

A record is ``{"image": "file.png", "conversations": [{"from": "human", "value": "<image>\\n
..."}, {"from": "gpt", "value": "..."}, ...]}`` (``image`` optional: a text-only record). Turns
are rendered ``USER: ...`` / ``ASSISTANT: ...</s>`` (LLaVA-1.5's layout); the loss is on the
assistant's words and end token only. ``<image>`` becomes one image token, which Megatron's
LLaVAModel expands to the tower's embeddings. Images are resized to the tower's square input
and normalised with its processor's mean and std (CLIP's or SigLIP's).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from anyspeed.errors import UsageError

NORMALISE = {
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
IMAGE_TAG = "<image>"


@dataclass(frozen=True)
class Sample:
    tokens: list[int]  # the text, one image token where the image goes
    learn: list[bool]  # per token: an assistant token (learned)
    image: str | None  # the image file


@dataclass
class VLMData:
    samples: list[Any]  # this module's Sample (LLaVA) or qwen_data's
    skipped: dict[str, list[str]] = field(default_factory=dict)  # why -> records

    def __len__(self) -> int:
        return len(self.samples)


def _encode(tok: Any, text: str, image_token: int) -> list[int]:
    pieces = text.split(IMAGE_TAG)
    out: list[int] = []
    for i, ids in enumerate(tok.encode(pieces, special=False)):
        if i:
            out.append(image_token)
        out.extend(ids)
    return out


def render(record: dict[str, Any], tok: Any, image_token: int) -> tuple[list[int], list[bool]]:
    """Tokens and their learn flags of one record's conversation."""
    tokens: list[int] = []
    learn: list[bool] = []
    end = [tok.eod_id] if tok.eod_id is not None else []
    for turn in record["conversations"]:
        if turn.get("from") in ("human", "user"):
            ids, flag = _encode(tok, f"USER: {turn['value']}\n", image_token), False
            tokens += ids
            learn += [flag] * len(ids)
        else:
            head = _encode(tok, "ASSISTANT: ", image_token)
            body = _encode(tok, str(turn["value"]), image_token) + end
            tokens += head + body
            learn += [False] * len(head) + [True] * len(body)
    return tokens, learn


# Images are refused above this many pixels (--max-image-pixels) before they are decoded: the
# towers see at most 384 x 384, and a 12000 x 12000 PNG of 420 KB decodes to 1.6 GB.
MAX_IMAGE_PIXELS = 4096 * 4096


def image_problem(path: str, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[str, str] | None:
    """(kind, reason) why image file ``path`` cannot be used (missing, too large, undecodable),
    or None; only its header is read."""
    if not os.path.isfile(path):
        return "missing image", "does not exist"
    try:
        from PIL import Image

        with Image.open(path) as im:
            w, h = im.size
            if w * h > max_pixels:
                return "image too large", (
                    f"is {w} x {h} = {w * h} pixels, over --max-image-pixels {max_pixels}"
                )
            im.verify()
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a bad image
        return "undecodable image", f"cannot be decoded ({type(exc).__name__})"
    return None


def _problem(
    record: Any, folder: str, tokens: list[int], image_token: int, max_pixels: int
) -> tuple[str, str] | None:
    """(kind, message) of why a record cannot train; None: it can."""
    tags = tokens.count(image_token)
    image = record.get("image")
    if image is None:
        return ("image tags", f"{tags} {IMAGE_TAG} tags and no image") if tags else None
    if tags != 1:
        return "image tags", f"{tags} {IMAGE_TAG} tags for one image"
    path = os.path.join(folder, str(image))
    why = image_problem(path, max_pixels)
    return None if why is None else (why[0], f"image {path!r} {why[1]}")


def read(
    path: str,
    folder: str,
    tok: Any,
    image_token: int,
    text_len: int,
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> VLMData:
    """Every record of ``path`` that can train (cut to ``text_len`` + 1 tokens); records with
    a missing or broken image, or image tags that do not match their images, are skipped and
    counted by reason. A line that is not a conversation record is an error naming it."""
    data = VLMData([])
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--data-path {path!r} line {n}"
            try:
                record = json.loads(line)
                turns = record["conversations"]
                assert isinstance(turns, list) and turns
            except (ValueError, KeyError, TypeError, AssertionError):
                raise UsageError(
                    f"{where}: not a LLaVA record (a JSON object with a "
                    "non-empty 'conversations' list)"
                ) from None
            tokens, learn = render(record, tok, image_token)
            why = _problem(record, folder, tokens, image_token, max_pixels)
            tokens, learn = tokens[: text_len + 1], learn[: text_len + 1]
            if why is None and not any(learn[1:]):
                why = "nothing to learn", "no assistant token within --seq-length"
            if why:
                data.skipped.setdefault(why[0], []).append(f"line {n}: {why[1]}")
                continue
            image = os.path.join(folder, record["image"]) if record.get("image") else None
            data.samples.append(Sample(tokens, learn, image))
    return data


def load_image(path: str, size: int, kind: str) -> torch.Tensor:
    """[3, size, size]: RGB, resized (bicubic), scaled to [0, 1] and normalised."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
        x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in NORMALISE[kind])
    return (x - mean) / std


def micro_batch(
    data: VLMData, idx: list[int], text_len: int, size: int, kind: str, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Tokens [b, text_len], labels, loss mask and the batch's images [n, 3, size, size]."""
    b = len(idx)
    tokens = torch.full((b, text_len), pad_id, dtype=torch.long)
    labels = torch.full((b, text_len), pad_id, dtype=torch.long)
    mask = torch.zeros((b, text_len), dtype=torch.float)
    images = []
    for row, i in enumerate(idx):
        s = data.samples[i]
        t = torch.tensor(s.tokens)
        n = len(s.tokens) - 1
        tokens[row, :n], labels[row, :n] = t[:-1], t[1:]
        mask[row, :n] = torch.tensor(s.learn[1:], dtype=torch.float)
        if s.image:
            images.append(load_image(s.image, size, kind))
    pixels = torch.stack(images) if images else torch.zeros(0, 3, size, size)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "images": pixels}
