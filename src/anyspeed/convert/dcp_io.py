"""Streaming reads and writes of Megatron's ``torch_dist`` format (PyTorch Distributed Checkpoint).

Megatron's ``dist_checkpointing.save`` needs every tensor of the state dict in memory at once, and
its load plans and validates per call. A conversion knows the tensors one group (embedding, layer,
head) at a time, so:

* :func:`streaming_save_strategy` is a ``torch_dist`` save strategy for ``dist_checkpointing.save``
  (which still writes ``metadata.json`` and ``common.pt`` and validates the sharding): the state
  dict's tensors are uninitialised placeholders, and each one's real data is produced only when
  the writer reaches it, in group order, and dropped once written. The files, ``.metadata`` and
  key layout are what Megatron's own strategy writes, so Megatron loads them at any layout.
* :class:`DcpReader` reads a region (a layer's slice of a layer-stacked key) straight from the
  files, whatever layout wrote the chunks, as views of the mapped files. ``.metadata`` and the
  chunks are read by :mod:`anyspeed.checkpoint` through :mod:`anyspeed.safe_pickle` (plain data
  only).
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from anyspeed.checkpoint.reads import read_metadata
from anyspeed.checkpoint.torch_files import load_torch_file
from anyspeed.convert.engine import Stacked, own_storage, take_rows
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.mapped import FileSink, deferred


@contextlib.contextmanager
def no_crc32() -> Iterator[None]:
    """Skip the zip CRC-32 of ``torch.save`` (a third of its time); readers do not check it.
    torch 2.6 has no such setting: there it is computed."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        yield
        return

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


# ------------------------------------------------------------------------------------ writing
class _Spans:
    """Which named placeholder tensor a view's memory belongs to (by address)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        rows = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, n) for n, t in tensors.items())
        self.starts = [r[0] for r in rows]
        self.rows = rows

    def find(self, view: torch.Tensor) -> tuple[str, int]:
        """(name, element offset of ``view`` inside that tensor)."""
        ptr = view.data_ptr()
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0 or ptr >= self.rows[i][1]:
            raise ConvertError("internal: a checkpoint tensor is not a view of a model tensor")
        start, _, name = self.rows[i]
        return name, (ptr - start) // view.element_size()


def streaming_save_strategy(
    placeholders: dict[str, torch.Tensor],
    group_of: Callable[[str], int],
    tensor_groups: Iterator[dict[str, torch.Tensor]],
):
    """A ``torch_dist`` save strategy writing ``tensor_groups`` (dicts name -> full tensor, in
    group order ``0, 1, ...``) where the state dict holds views of ``placeholders``."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import save as dcp_save

    planner = _planner_class(placeholders, group_of, tensor_groups)
    writer = _writer_class(group_of)

    class Strategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt = mcore_to_pyt_state_dict(sd, False)
            dcp_save(
                pyt,
                storage_writer=writer(checkpoint_dir, sync_files=False),
                planner=planner(flatten_state_dict=False),
            )
            if next(tensor_groups, None) is not None:
                raise ConvertError("internal: converted tensors left over after the last group")

    return Strategy("torch_dist", 1)


def _planner_class(
    placeholders: dict[str, torch.Tensor],
    group_of: Callable[[str], int],
    tensor_groups: Iterator[dict[str, torch.Tensor]],
) -> type:
    """Megatron's save planner, resolving a tensor item to the real data of its group, which is
    produced on first use (groups come in order) and dropped when the next one starts."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    spans = _Spans(placeholders)

    class Planner(MCoreSavePlanner):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.current: tuple[int, dict] = (-1, {})  # (group index, its tensors)

        def source(self, item) -> tuple[str, torch.Tensor]:
            view = self.lookup_object(item.index)
            return spans.find(view)[0], view

        def resolve_data(self, item):
            if item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(item)
            view = self.lookup_object(item.index)
            name, offset = spans.find(view)
            group = group_of(name)
            while self.current[0] < group:
                tensors = next(tensor_groups, None)
                if tensors is None:
                    raise ConvertError(f"internal: no source group for Megatron tensor {name}")
                self.current = (self.current[0] + 1, tensors)
            full = self.current[1].get(name)
            if full is None:
                raise ConvertError(f"internal: no source for Megatron tensor {name}")
            want = tuple(placeholders[name].shape)
            if tuple(full.shape) != want:
                raise ConvertError(
                    f"{name}: shape {tuple(full.shape)} does not match the model's {want}"
                )
            return _view_data(full, view, offset, self.current[1], name)

    return Planner


def _view_data(
    full: torch.Tensor | Stacked, view: torch.Tensor, offset: int, tensors: dict, name: str
) -> torch.Tensor:
    """The data of ``view`` (elements from ``offset`` of ``name``'s placeholder) taken from the
    full tensor; a lazy ``Stacked`` one is read by whole rows, or else materialised once (kept
    in ``tensors``)."""
    if isinstance(full, Stacked):
        row = math.prod(tuple(full.shape)[1:])
        if view.is_contiguous() and offset % row == 0 and view.numel() % row == 0:
            rows = take_rows(full, [(offset // row, (offset + view.numel()) // row)])
            if isinstance(rows, Stacked):  # the sink writes the parts, not this
                return deferred(rows, view.shape)
            return own_storage(rows.reshape(view.shape))
        full = tensors[name] = full.materialize()
    base = full.contiguous()  # a view (one expert's row of a stacked HF tensor) keeps its offset
    data = base.as_strided(view.shape, view.stride(), base.storage_offset() + offset)
    whole = data.untyped_storage().nbytes() == data.numel() * data.element_size()
    return data if whole else own_storage(data)


def _writer_class(group_of: Callable[[str], int]) -> type:
    """A DCP file writer: one file, tensors in group order, each produced just before it is
    written; mapped source bytes (most tensors are views of the input files) go file to file."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner) -> Future:
            name = f"{plan.storage_data.prefix}0.distcp"
            rows = [(0, -1, it) for it in plan.items if it.type == WriteItemType.BYTE_IO]
            for it in plan.items:
                if it.type != WriteItemType.BYTE_IO:
                    src, view = planner.source(it)
                    rows.append((1 + group_of(src), view.data_ptr(), it))
            rows.sort(key=lambda r: r[:2])
            results = []
            with FileSink(Path(self.path) / name) as f, no_crc32():
                for _, _, it in rows:
                    data = planner.resolve_data(it)
                    start = f.tell()
                    if it.type == WriteItemType.BYTE_IO:
                        f.write(data.getbuffer())
                    else:
                        torch.save(data, f)
                    length = f.tell() - start
                    results.append(WriteResult(it.index, length, _StorageInfo(name, start, length)))
            fut: Future = Future()
            fut.set_result(results)
            return fut

        def storage_meta(self) -> StorageMeta:
            return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    return Writer


# ------------------------------------------------------------------------------------ reading
class DcpReader:
    """Regions of the tensors of a ``torch_dist`` checkpoint directory, read from its files."""

    def __init__(self, it_dir: str | Path) -> None:
        self.dir = Path(it_dir)
        self.meta = read_metadata(self.dir)
        self.tensors = self.meta.state_dict_metadata
        self.storage = self.meta.storage_data
        self._index: dict[str, tuple[list[int], list, int]] = {}
        self._sizes: dict[Path, int] = {}

    def _chunks_near(self, key: str, lo: int, hi: int) -> list:
        """The chunks of ``key`` that may overlap rows ``[lo, hi)`` of its first dim: found by
        bisection (a layer's or an expert's region is a few of a stacked key's many chunks)."""
        if key not in self._index:
            chunks = sorted(
                self.tensors[key].chunks, key=lambda c: c.offsets[0] if c.offsets else 0
            )
            starts = [c.offsets[0] if c.offsets else 0 for c in chunks]
            longest = max((c.sizes[0] if c.sizes else 1 for c in chunks), default=1)
            self._index[key] = (starts, chunks, longest)
        starts, chunks, longest = self._index[key]
        return chunks[bisect.bisect_left(starts, lo - longest + 1) : bisect.bisect_left(starts, hi)]

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.tensors or not hasattr(self.tensors[key], "chunks"):
            raise ConvertError(f"{self.dir}: the checkpoint has no tensor {key}")
        return tuple(self.tensors[key].size)

    def _chunk(self, key: str, offsets) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.storage.get(MetadataIndex(key, offsets))
        if info is None:
            raise ConvertError(f"{self.dir}: no storage for {key} at {list(offsets)}")
        if getattr(info, "transform_descriptors", None):
            raise ConvertError(
                f"{self.dir}: {key} is stored transformed "
                f"({info.transform_descriptors}); not supported"
            )
        path = self.dir / info.relative_path
        if path not in self._sizes:
            self._sizes[path] = path.stat().st_size if path.is_file() else -1
        if self._sizes[path] < info.offset + info.length:
            raise ConvertError(f"{path}: missing or truncated ({key})")
        if not info.length:
            raise ConvertError(f"{path}: empty record for {key}")
        # The chunk's tensor is a view of the mapped file: nothing is copied until it is written.
        return load_torch_file(path, info.offset, info.length, f"{path} ({key})")

    def read(
        self, key: str, offset: tuple[int, ...], size: tuple[int, ...], squeeze: int = 0
    ) -> torch.Tensor | Stacked:
        """The region ``[offset, offset + size)`` of global tensor ``key``, without its first
        ``squeeze`` dims (each of size 1). The chunks' bytes stay mapped when the region is
        one chunk or chunks stacked along its first remaining dim (a :class:`Stacked` then);
        otherwise the region is assembled in memory."""
        md = self.tensors.get(key)
        self.shape(key)
        if any(n != 1 for n in size[:squeeze]):
            raise ConvertError(f"internal: cannot drop dims of size {list(size[:squeeze])}")
        pieces = []  # (region-global lower and upper bounds, view of the chunk)
        near = self._chunks_near(key, offset[0], offset[0] + size[0]) if size else md.chunks
        for ch in near:
            lo = [max(o, c) for o, c in zip(offset, ch.offsets, strict=True)]
            hi = [
                min(o + s, c + n)
                for o, s, c, n in zip(offset, size, ch.offsets, ch.sizes, strict=True)
            ]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            t = self._chunk(key, ch.offsets)
            if tuple(t.shape) != tuple(ch.sizes) or t.dtype != md.properties.dtype:
                raise ConvertError(
                    f"{self.dir}: {key} chunk at {list(ch.offsets)} is {t.dtype} "
                    f"{list(t.shape)}, the metadata says {md.properties.dtype} {list(ch.sizes)}"
                )
            view = t[tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, ch.offsets, strict=True))]
            pieces.append((lo, hi, view))
        if sum(v.numel() for _, _, v in pieces) != math.prod(size):
            raise ConvertError(
                f"{self.dir}: {key} does not cover the region {list(offset)} + "
                f"{list(size)} (chunks missing or overlapping)"
            )
        out_shape = tuple(size[squeeze:])
        d = squeeze  # pieces that span the region but along dim d are rows of the result
        ends = [o + s for o, s in zip(offset, size, strict=True)]
        if all(
            lo[i] == offset[i] and hi[i] == ends[i]
            for lo, hi, _ in pieces
            for i in range(len(size))
            if i != d
        ):
            pieces.sort(key=lambda p: p[0][d])
            if all(a[1][d] == b[0][d] for a, b in zip(pieces, pieces[1:], strict=False)):
                views = [v.reshape(v.shape[squeeze:]) for _, _, v in pieces]
                return views[0] if len(views) == 1 else Stacked(views)
        out = torch.empty(size, dtype=md.properties.dtype)
        for lo, hi, view in pieces:
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))] = view
        return out.reshape(out_shape)
