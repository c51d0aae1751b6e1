"""Hugging Face checkpoint directories: read (sharded) safetensors, write them streaming."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from pathlib import Path

import torch

from anyspeed.checkpoint.file_maps import map_file
from anyspeed.convert.engine import Stacked
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.mapped import FileSink, byte_view
from anyspeed.convert.safetensors_check import Entry, read_header

INDEX = "model.safetensors.index.json"
# Files of an HF directory that are weights (not copied along with the tokenizer/config).
_WEIGHTS = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    INDEX,
    "pytorch_model.bin.index.json",
)


_JSON_MAX = 64 << 20  # config.json and the index are small; a larger one is not read


def read_json(path: Path) -> dict:
    """A JSON object file of an HF directory; one ConvertError line when it is anything else."""
    try:
        size = path.stat().st_size
        raw = path.read_bytes() if size <= _JSON_MAX else b""
    except OSError as exc:
        raise ConvertError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if size > _JSON_MAX:
        raise ConvertError(f"{path}: larger than {_JSON_MAX >> 20} MiB (not a JSON config)")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ConvertError(f"{path}: not valid JSON ({str(exc) or 'nested too deep'})") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return value


# Vision-language checkpoints read as their text model (the published Qwen3.5 checkpoints are
# these): architecture -> the text model's; its tensors are the ones under TEXT_PREFIX (and the
# output layer), the vision tower's and the MTP layers' are left out.
TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
TEXT_PREFIX = "model.language_model."


def read_config(directory: str | Path, raw: bool = False) -> dict:
    """``config.json`` of an HF directory (checked to be a JSON object); for a vision-language
    checkpoint of :data:`TEXT_MODEL_OF`, its text model's config unless ``raw``."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConvertError(f"{directory}: no config.json (not a Hugging Face model directory)")
    config = read_json(path)
    return config if raw else text_model_config(config, path)


def text_model_config(config: dict, path: Path) -> dict:
    """``config`` itself, or a vision-language checkpoint's text model's config."""
    vlm = vlm_architecture(config)
    if vlm is None:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConvertError(f"{path}: {vlm} without a text_config")
    text = dict(text, architectures=[TEXT_MODEL_OF[vlm]])
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return text


def vlm_architecture(config: dict) -> str | None:
    """The :data:`TEXT_MODEL_OF` architecture ``config`` names, or None."""
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    return arch if arch in TEXT_MODEL_OF else None


def text_model_note(directory: str | Path) -> str | None:
    """One line saying that ``directory`` is read as its text model, or None."""
    ck = HFCheckpoint(directory)
    if ck.vlm is None:
        return None
    return (
        f"{directory} is a {ck.vlm}: its text model is read as {TEXT_MODEL_OF[ck.vlm]}; "
        f"{len(ck.left_out)} tensors of the vision tower and MTP layers are left out"
    )


def text_model_names(names: list[str]) -> tuple[dict[str, str], list[str]]:
    """(text-model name -> stored name, the names left out) of a vision-language checkpoint's
    tensors: ``model.language_model.X`` reads as ``model.X``, ``lm_head.weight`` as itself."""
    kept, left = {}, []
    for name in names:
        if name.startswith(TEXT_PREFIX):
            kept["model." + name[len(TEXT_PREFIX) :]] = name
        elif name == "lm_head.weight":
            kept[name] = name
        else:
            left.append(name)
    return kept, left


_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
}
_CODES = {v: k for k, v in _DTYPES.items()}


def file_in(directory: Path, name: object, source: Path | str) -> Path:
    """``directory / name`` when ``name`` (named by ``source``) is a plain file name whose file
    stays inside ``directory``; a Hugging Face hub cache snapshot's links into its repository's
    ``blobs/`` are the one way out that is allowed."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or Path(name).name != name
        or "\\" in name
        or "\0" in name
    ):
        raise ConvertError(
            f"{source} names {name!r}, not a file in {directory} (absolute "
            "paths and .. are refused)"
        )
    root = directory.resolve()
    real = (directory / name).resolve()
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if not (real.is_relative_to(root) or (hub_blobs and real.parent == hub_blobs)):
        raise ConvertError(f"{directory / name}: a link to {real}, outside {directory} (refused)")
    return directory / name


class HFCheckpoint:
    """Tensors of an HF directory's safetensors files, one at a time: read into their own
    memory, or mapped copy-on-write for the duration of the tensor (:meth:`get`)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        raw = read_config(self.dir, raw=True)
        self.config = text_model_config(raw, self.dir / "config.json")
        self._headers: dict[str, tuple[int, dict[str, Entry]]] = {}
        index = self.dir / INDEX
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not (
                isinstance(weight_map, dict)
                and weight_map
                and all(isinstance(v, str) for v in weight_map.values())
            ):
                raise ConvertError(
                    f"{index}: no weight_map of tensor name -> shard file name "
                    "(as transformers writes it)"
                )
            self.weight_map: dict[str, str] = weight_map
        elif (self.dir / "model.safetensors").is_file():
            names = self._header("model.safetensors")[1]
            self.weight_map = dict.fromkeys(names, "model.safetensors")
        else:
            raise ConvertError(
                f"{self.dir}: no model.safetensors or {INDEX} (only safetensors weights are read)"
            )
        for shard in sorted(set(self.weight_map.values()), key=str):
            if not file_in(self.dir, shard, f"{index}: weight_map").is_file():
                raise ConvertError(f"{self.dir}: missing shard {shard} (listed in {INDEX})")
            self._header(shard)  # every header checked before any tensor is read
        # a vision-language checkpoint: its text model's tensors under their text-model names
        self.stored = {name: name for name in self.weight_map}
        self.left_out: list[str] = []
        self.vlm = vlm_architecture(raw)
        if self.vlm is not None:
            self.stored, self.left_out = text_model_names(list(self.weight_map))

    def _header(self, shard: str) -> tuple[int, dict[str, Entry]]:
        if shard not in self._headers:
            self._headers[shard] = read_header(
                file_in(self.dir, shard, f"{self.dir / INDEX}: weight_map")
            )
        return self._headers[shard]

    def _entry(self, name: str) -> tuple[Path, int, Entry]:
        if name not in self.stored:
            raise ConvertError(f"{self.dir}: tensor {name} is missing")
        name = self.stored[name]
        shard = self.weight_map[name]
        start, header = self._header(shard)
        if name not in header:
            raise ConvertError(f"{self.dir}: tensor {name} is not in {shard}")
        return self.dir / shard, start, header[name]

    @property
    def names(self) -> list[str]:
        return list(self.stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2].shape

    def dtype(self, name: str) -> torch.dtype:
        code = self._entry(name)[2].dtype
        if code not in _DTYPES:
            raise ConvertError(f"{self.dir}: tensor {name} has unsupported dtype {code}")
        return _DTYPES[code]

    def get(self, name: str, mapped: bool = False) -> torch.Tensor:
        """Tensor ``name``, read into its own memory, or with ``mapped`` a copy-on-write map of
        the file's bytes: no copy and 16x fewer page faults (the kernel maps file pages in
        runs), for tensors that are only read and written out. The map is released with the
        tensor, so only tensors still alive count as this process's memory. The header was
        checked when the shard was first opened (:func:`read_header`)."""
        path, start, entry = self._entry(name)
        dtype, shape = self.dtype(name), entry.shape
        need = entry.end - entry.begin
        if mapped and need:
            at = start + entry.begin
            if path.stat().st_size < at + need:  # cut short since its header was read
                raise ConvertError(f"{path}: truncated (tensor {name})")
            return map_file(path, at, need).view(dtype).view(shape)
        t = torch.empty(shape, dtype=dtype)
        buf = byte_view(t)
        with open(path, "rb") as f:
            f.seek(start + entry.begin)
            if len(buf) and f.readinto(buf) != len(buf):
                raise ConvertError(f"{path}: truncated (tensor {name})")
        return t


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """Bytes of a size written as transformers' ``max_shard_size`` is (5GB, 500MB, 2GiB) or
    a plain number of bytes; one ConvertError line naming ``flag`` otherwise."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = _UNITS.get(m.group(2).upper()) if m else None
    size = int(float(m.group(1)) * unit) if unit and len(m.group(1)) < 20 else 0
    if size < 1:
        raise ConvertError(
            f"{flag} {text!r}: expected a size such as 5GB, 500MB, 2GiB or a number of bytes"
        )
    return size


class ShardedWriter:
    """Streams tensors into ``model-XXXXX-of-YYYYY.safetensors`` + index, holding none of them.

    Names, shapes and arrival order are known up front (``plan``), so the shard split and a
    bound on each header's size are too: each tensor is written at its offset as it arrives,
    and the header (padded with spaces, which the format allows) when its shard is complete.
    """

    def __init__(
        self,
        directory: Path,
        plan: list[tuple[str, tuple[int, ...]]],
        max_shard_size: str | int = "5GB",
    ) -> None:
        self.dir, self.plan, self.max = Path(directory), plan, parse_size(max_shard_size)
        self.shard_of: dict[str, int] = {}
        self.files: list[str] = []
        self.reserve: list[int] = []
        self.f: FileSink | None = None
        self.idx, self.offset, self.header = -1, 0, {}
        self.total = 0

    def _split(self, itemsize: int) -> None:
        shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        size = 0
        for name, shape in self.plan:
            nbytes = itemsize * math.prod(shape)
            if shards[-1] and size + nbytes > self.max:
                shards.append([])
                size = 0
            shards[-1].append((name, shape))
            size += nbytes
        n = len(shards)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, names in enumerate(shards):
            self.shard_of.update((name, i) for name, _ in names)
            worst = {
                name: {"dtype": "BF16", "shape": list(shape), "data_offsets": [10**15] * 2}
                for name, shape in names
            }
            worst["__metadata__"] = {"format": "pt"}
            self.reserve.append(8 + -(-(len(json.dumps(worst)) + 64) // 8) * 8)

    def add(self, tensors: dict[str, torch.Tensor | Stacked]) -> None:
        for name, t in tensors.items():
            if not self.files:
                self._split(t.dtype.itemsize)
            if name not in self.shard_of:
                raise ConvertError(f"internal: tensor {name} is not in the output plan")
            idx = self.shard_of[name]
            if idx != self.idx:
                if idx < self.idx:
                    raise ConvertError(f"internal: tensor {name} arrived after its shard closed")
                self._close_shard()
                self.f = FileSink(self.dir / self.files[idx])
                self.f.seek(self.reserve[idx])
                self.idx, self.offset, self.header = idx, 0, {}
            # A lazy concatenation is written part by part; mapped bytes go file to file.
            end = self.offset + self.f.write_tensor(t)
            self.header[name] = {
                "dtype": _CODES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [self.offset, end],
            }
            self.offset = end
            self.total += end - self.header[name]["data_offsets"][0]

    def _close_shard(self) -> None:
        if self.f is None:
            return
        text = json.dumps({"__metadata__": {"format": "pt"}, **self.header}).encode()
        room = self.reserve[self.idx] - 8
        if len(text) > room:
            raise ConvertError("internal: safetensors header larger than reserved")
        self.f.seek(0)
        self.f.write(struct.pack("<Q", room) + text + b" " * (room - len(text)))
        self.f.close()
        self.f = None

    def close(self) -> dict[str, str]:
        """Finish the last shard and write the index. Returns the weight map."""
        self._close_shard()
        weight_map = {name: self.files[i] for name, i in self.shard_of.items()}
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def copy_side_files(src: str | Path, dst: Path) -> list[str]:
    """Copy the tokenizer / config / template files of an HF directory (not its weights)."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHTS) and not f.name.startswith("."):
            file_in(Path(src), f.name, src)  # a link out of the directory is not copied along
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied
