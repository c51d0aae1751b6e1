"""Image-text data of the ``vlm`` stage for Qwen2-VL / Qwen2.5-VL: MindSpeed-MM's and
LLaMA-Factory's ``mllm`` layout, rendered in Qwen's chat format, pixels from transformers' image
processor.

A record (one object of a ``.json`` array, or one line of a ``.jsonl``)::

    {"messages": [{"role": "user", "content": "<image>What is drawn?"},
                  {"role": "assistant", "content": "a red circle"}],
     "images": ["images/1.png"], "videos": [["f0.png", "f1.png", "f2.png", "f3.png"]]}

``conversations`` with ``from``/``value`` (ShareGPT) and ``image`` for ``images`` read the same.
Each ``<image>`` (``<video>``) takes the record's next image (video) in order and becomes
``<|vision_start|>`` + n x ``<|image_pad|>`` + ``<|vision_end|>``, n = t*h*w / merge**2 of the
input's grid, which comes from the image header alone (transformers' ``smart_resize``). A video
is a list of frame files (or a folder of them). The loss is on the assistant's words and its
``<|im_end|>``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.stages.vlm.data import VLMData, image_problem

IMAGE_TAG, VIDEO_TAG = "<image>", "<video>"
SYSTEM = "You are a helpful assistant."
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
SECONDS_PER_GRID = 2 / 2.0  # two frames per grid step at the processor's 2 frames per second
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class Sample:
    tokens: list[int]  # the rendered conversation, vision blocks expanded
    learn: list[bool]  # per token: an assistant token (learned)
    images: tuple[str, ...]
    videos: tuple[tuple[str, ...], ...]  # frame files of each video
    grids: tuple[tuple[int, int, int], ...] = ()  # (t, h, w) of the images, then the videos


@dataclass(frozen=True)
class Vision:
    """The tower's input geometry and the special token ids (from the model's config)."""

    image_token: int
    video_token: int
    start_token: int
    end_token: int
    patch: int
    merge: int
    temporal: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def of(cls, hf_config: dict[str, Any], processor: dict[str, Any]) -> Vision:
        """The rule of an HF Qwen-VL config and its image processor's settings."""
        from anyspeed.models.qwen_vl.config import tower_from_hf

        c, t, p = hf_config, tower_from_hf(hf_config["vision_config"]), processor
        ids = (c["image_token_id"], c["video_token_id"])
        ends = (c["vision_start_token_id"], c["vision_end_token_id"])
        geometry = (t.patch_size, t.spatial_merge_size, t.temporal_patch_size)
        return cls(*ids, *ends, *geometry, p["min_pixels"], p["max_pixels"])

    @property
    def markers(self) -> list[int]:
        """The tokens that only mark inputs (pads, start, end): never an answer's."""
        return [self.image_token, self.video_token, self.start_token, self.end_token]

    def grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        """(t, h, w) in patches of an input of ``frames`` frames of ``width`` x ``height``."""
        from anyspeed.data.qwen_vl_pixels import smart_resize

        h, w = smart_resize(
            height, width, self.patch * self.merge, self.min_pixels, self.max_pixels
        )
        t = max(1, -(-frames // self.temporal))
        return t, h // self.patch, w // self.patch

    def block(self, token: int, grid: tuple[int, int, int]) -> list[int]:
        t, h, w = grid
        return [self.start_token, *[token] * (t * h * w // self.merge**2), self.end_token]


def _turns(record: Any) -> list[tuple[str, str]]:
    """(role, text) of each turn; ValueError when the record has none."""
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise ValueError
    out = []
    for t in turns:
        role = ROLES.get(t.get("role", t.get("from")), t.get("role", t.get("from")))
        if role not in ("system", "user", "assistant"):
            raise ValueError
        out.append((role, str(t.get("content", t.get("value", "")))))
    return out


def _inputs(record: dict, key: str, single: str) -> list:
    value = record.get(key, record.get(single))
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _frames(folder: str, video: Any) -> tuple[str, ...]:
    """A video's frame files: a list of them, or every image of a folder in name order."""
    if isinstance(video, list):
        return tuple(os.path.join(folder, str(f)) for f in video)
    path = os.path.join(folder, str(video))
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.lower().endswith(IMAGE_SUFFIXES))
        return tuple(os.path.join(path, n) for n in names)
    raise ValueError(f"video: {path!r} is not a list of frames or a folder of them")


def _size(path: str, max_pixels: int) -> tuple[int, int]:
    """(width, height) from the header; ValueError naming the file when it cannot be used."""
    why = image_problem(path, max_pixels)
    if why is not None:
        raise ValueError(f"{why[0]}: {path!r} {why[1]}")
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def _encode(tok: Any, text: str, blocks: list[list[int]], tag: str, rest: Any) -> list[int]:
    """Tokens of ``text``: each ``tag`` takes the next of ``blocks``; other text through
    ``rest`` (which expands the other tag the same way)."""
    out: list[int] = []
    for i, piece in enumerate(text.split(tag)):
        if i:
            if not blocks:
                raise ValueError(f"{tag} tags: more {tag} tags than inputs")
            out += blocks.pop(0)
        out += rest(piece)
    return out


def render(
    record: dict, folder: str, tok: Any, vision: Vision, max_file_pixels: int
) -> tuple[Sample, list[bool]]:
    """One record as a :class:`Sample` (ValueError with the reason when it cannot train)."""
    turns = _turns(record)
    images = [os.path.join(folder, str(p)) for p in _inputs(record, "images", "image")]
    videos = [_frames(folder, v) for v in _inputs(record, "videos", "video")]
    grids = [vision.grid(*_size(p, max_file_pixels)) for p in images]
    image_blocks = [vision.block(vision.image_token, g) for g in grids]
    video_blocks = []
    for frames in videos:
        sizes = {_size(f, max_file_pixels) for f in frames}
        if len(sizes) != 1:
            raise ValueError(f"video frames: {frames[0]!r}...: {len(sizes)} sizes, need one")
        grids.append(vision.grid(*sizes.pop(), frames=len(frames)))
        video_blocks.append(vision.block(vision.video_token, grids[-1]))

    def plain(text: str) -> list[int]:
        return tok.encode([text], special=False)[0] if text else []

    def text_ids(text: str) -> list[int]:
        return _encode(tok, text, video_blocks, VIDEO_TAG, plain)

    tokens: list[int] = []
    learn: list[bool] = []
    if turns[0][0] != "system":
        turns.insert(0, ("system", SYSTEM))
    for role, text in turns:
        head = plain(f"<|im_start|>{role}\n")
        body = _encode(tok, text, image_blocks, IMAGE_TAG, text_ids)
        end, newline = plain("<|im_end|>"), plain("\n")
        learned = role == "assistant"
        tokens += head + body + end + newline
        learn += [False] * len(head) + [learned] * (len(body) + len(end)) + [False] * len(newline)
    if image_blocks or video_blocks:
        raise ValueError(
            f"tags: {len(image_blocks)} image(s) and {len(video_blocks)} video(s) have no "
            f"{IMAGE_TAG}/{VIDEO_TAG} tag"
        )
    _check_pads(tokens, vision, grids, len(images))
    return Sample(tokens, learn, tuple(images), tuple(videos), tuple(grids)), learn


def _check_pads(tokens: list[int], vision: Vision, grids: list, n_images: int) -> None:
    """ValueError when the text itself holds vision pad tokens (written out literally): the
    model would find more pads than the inputs have features."""
    unit = vision.merge**2
    for token, name, part in (
        (vision.image_token, "image", grids[:n_images]),
        (vision.video_token, "video", grids[n_images:]),
    ):
        want = sum(t * h * w // unit for t, h, w in part)
        got = tokens.count(token)
        if got != want:
            raise ValueError(
                f"{name} pads: the text holds {got - want} {name} pad token(s) beyond its "
                f"{name}s' {want} (write {IMAGE_TAG}/{VIDEO_TAG}, not the pad token)"
            )


def _records(path: str) -> list[tuple[str, Any]]:
    """(where, record) of every record of a ``.json`` array or a ``.jsonl`` file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"--data-path {path!r}: not valid JSON ({exc})") from None
        return [(f"record {i}", r) for i, r in enumerate(items)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"line {n}", json.loads(line)))
            except ValueError:
                raise UsageError(f"--data-path {path!r} line {n}: not a JSON object") from None
    return out


def read(
    path: str, folder: str, tok: Any, vision: Vision, seq_len: int, max_file_pixels: int
) -> VLMData:
    """Every record of ``path`` that can train within ``seq_len`` + 1 tokens; a record with a
    missing or broken image, tags that do not match its inputs, or vision tokens past
    ``seq_len`` is skipped and counted by reason. A record without turns is an error naming it."""
    data = VLMData([])
    for where, record in _records(path):
        try:
            _turns(record) if isinstance(record, dict) else _turns({})
        except (ValueError, AttributeError):
            raise UsageError(
                f"--data-path {path!r} {where}: not a conversation record (an object with a "
                "non-empty 'messages' list of role/content turns)"
            ) from None
        try:
            sample, learn = render(record, folder, tok, vision, max_file_pixels)
        except ValueError as exc:
            kind = str(exc).split(":")[0] if ":" in str(exc) else "bad input"
            data.skipped.setdefault(kind, []).append(f"{where}: {exc}")
            continue
        if _cuts_vision(sample.tokens, seq_len + 1, vision):
            why = f"its images end past --seq-length {seq_len}"
            data.skipped.setdefault("too long", []).append(f"{where}: {why}")
            continue
        tokens, learn = sample.tokens[: seq_len + 1], learn[: seq_len + 1]
        if not any(learn[1:]):
            data.skipped.setdefault("nothing to learn", []).append(
                f"{where}: no assistant token within --seq-length"
            )
            continue
        data.samples.append(dataclasses.replace(sample, tokens=tokens, learn=learn))
    return data


def _cuts_vision(tokens: list[int], keep: int, vision: Vision) -> bool:
    """Whether keeping ``keep`` tokens cuts into (or drops) a vision block."""
    pads = (vision.image_token, vision.video_token)
    return any(t in pads for t in tokens[keep - 1 :])


def micro_batch(
    data: VLMData, idx: list[int], seq_len: int, pixels: Any, seconds: bool, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Tokens [b, seq_len] (right-padded), labels, loss mask, and the batch's pixel rows and
    grids in order of appearance (``pixels`` None: the grids alone, which a later pipeline
    stage's positions need; no image is decoded)."""
    b = len(idx)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((b, seq_len), dtype=torch.float)
    images: list[str] = []
    videos: list[tuple[str, ...]] = []
    grids: list[list[tuple[int, int, int]]] = [[], []]
    for row, i in enumerate(idx):
        s = data.samples[i]
        t = torch.tensor(s.tokens)
        n = len(s.tokens) - 1
        tokens[row, :n], labels[row, :n] = t[:-1], t[1:]
        mask[row, :n] = torch.tensor(s.learn[1:], dtype=torch.float)
        images += s.images
        videos += s.videos
        grids[0] += s.grids[: len(s.images)]
        grids[1] += s.grids[len(s.images) :]
    out = {"tokens": tokens, "labels": labels, "loss_mask": mask}
    if pixels is not None:
        return {**out, **vision_inputs(images, videos, pixels, seconds)}
    for key, g in zip(("image_grid_thw", "video_grid_thw"), grids, strict=True):
        if g:
            out[key] = torch.tensor(g)
    if grids[1] and seconds:
        out["second_per_grid_ts"] = torch.full((len(grids[1]),), SECONDS_PER_GRID)
    return out


def vision_inputs(
    images: list[str], videos: list[tuple[str, ...]], pixels: Any, seconds: bool
) -> dict[str, torch.Tensor]:
    """The model's pixel rows and grids of ``images`` and ``videos`` (frame files), in order;
    ``second_per_grid_ts`` (Qwen2.5-VL, ``seconds``) at the processor's 2 frames per second."""
    out = {}
    if images:
        out["pixel_values"], out["image_grid_thw"] = pixels.images(images)
    if videos:
        rows, grids = zip(*(pixels.video(list(v)) for v in videos), strict=True)
        out["pixel_values_videos"], out["video_grid_thw"] = torch.cat(rows), torch.cat(grids)
        if seconds:
            out["second_per_grid_ts"] = torch.full((len(videos),), SECONDS_PER_GRID)
    return out
