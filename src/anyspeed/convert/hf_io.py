"""Hugging Face checkpoint directories: read (sharded) safetensors, write them streaming."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from anyspeed.convert.errors import ConvertError

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


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConvertError(f"{directory}: no config.json (not a Hugging Face model directory)")
    return json.loads(path.read_text())


class HFCheckpoint:
    """Tensors of an HF directory, opened lazily (memory-mapped) shard by shard."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.config = read_config(self.dir)
        self._handles: dict[str, object] = {}
        index = self.dir / INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            self.weight_map = dict.fromkeys(
                self._open("model.safetensors").keys(), "model.safetensors"
            )
        else:
            raise ConvertError(
                f"{self.dir}: no model.safetensors or {INDEX} (only safetensors weights are read)"
            )
        for shard in sorted(set(self.weight_map.values())):
            if not (self.dir / shard).is_file():
                raise ConvertError(f"{self.dir}: missing shard {shard} (listed in {INDEX})")

    def _open(self, shard: str):
        from safetensors import safe_open

        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.dir / shard), framework="pt")
        return self._handles[shard]

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConvertError(f"{self.dir}: tensor {name} is missing")
        return self._open(self.weight_map[name]).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


def _size_bytes(text: str | int) -> int:
    if isinstance(text, int):
        return text
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


class ShardedWriter:
    """Writes tensors as ``model-XXXXX-of-YYYYY.safetensors`` + index, one shard in memory."""

    def __init__(self, directory: Path, max_shard_size: str | int = "5GB") -> None:
        self.dir, self.max = Path(directory), _size_bytes(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            size = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + size > self.max:
                self.flush()
            self.pending[name] = t.contiguous()
            self.pending_bytes += size
            self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        save_file(self.pending, str(self.dir / f".shard-{len(self.shards)}"), {"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Name the shards now that their count is known; write the index. Returns weight_map."""
        self.flush()
        n, weight_map = len(self.shards), {}
        for i, names in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f".shard-{i}", self.dir / fname)
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def copy_side_files(src: str | Path, dst: Path) -> list[str]:
    """Copy the tokenizer / config / template files of an HF directory (not its weights)."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHTS) and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def tensor_dtype(ck: HFCheckpoint, name: str) -> torch.dtype:
    text = ck._open(ck.weight_map[name]).get_slice(name).get_dtype()
    if text not in _DTYPES:
        raise ConvertError(f"{ck.dir}: tensor {name} has unsupported dtype {text}")
    return _DTYPES[text]
