"""Mapped checkpoint bytes (:mod:`anyspeed.convert.mapped`): the file-to-file sink and the
mapped ``torch.save`` reader, checked against plain file reads and ``torch.load``."""

from __future__ import annotations

import argparse
import collections
import gc
import os

import pytest
import torch

from anyspeed.checkpoint import file_maps, torch_files
from anyspeed.checkpoint.errors import CheckpointFileError
from anyspeed.convert import mapped


@pytest.fixture
def blob(tmp_path):
    data = os.urandom(3 * mapped.MIN_RANGE + 12345)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    return path, data


def test_sink_copies_mapped_bytes_file_to_file(blob, tmp_path):
    path, data = blob
    lo, n = 4099, 2 * mapped.MIN_RANGE + 7  # not page aligned
    view = file_maps.map_file(path, lo, n)
    assert file_maps.file_range(view.numpy()) == (str(path), lo)
    assert file_maps.file_range(view[10:].numpy()) == (str(path), lo + 10)
    out = tmp_path / "out.bin"
    with mapped.FileSink(out) as f:
        f.write(b"head")
        f.write(view.numpy())
        f.write(b"tail")
    assert out.read_bytes() == b"head" + data[lo : lo + n] + b"tail"
    assert f.copied == (n if hasattr(os, "copy_file_range") else 0)


def test_sink_parts_in_order_whatever_their_source(blob, tmp_path):
    """Mapped and in-memory, large and small buffers, written as one concatenation."""
    path, data = blob
    mv = file_maps.map_file(path, 0, len(data))
    mem = torch.randint(0, 255, (mapped.MIN_RANGE * 2,), dtype=torch.uint8)
    big = mapped.MIN_RANGE
    parts = [mv[:100], mem[:5], mv[200 : 200 + big], mem, mv[7:9], mv[-big:]]
    parts += [mem[i : i + 3] for i in range(0, 3 * 1100, 3)]  # more than one pwritev batch
    out = tmp_path / "out.bin"
    with mapped.FileSink(out) as f:
        f.seek(10)
        n = f.write_parts([p.numpy() for p in parts])
        f.seek(0)
        f.write(b"0123456789")
    want = b"0123456789" + b"".join(p.numpy().tobytes() for p in parts)
    assert n == len(want) - 10 and out.read_bytes() == want


def test_map_is_forgotten_with_its_last_tensor(blob):
    path, _ = blob
    gc.collect()
    before = set(file_maps._regions)
    t = file_maps.map_file(path, 0, 1000)
    (mine,) = set(file_maps._regions) - before  # others' maps may be freed meanwhile
    part = t[10:20].view(torch.int16)
    del t
    gc.collect()
    assert mine in file_maps._regions  # a view still holds the map
    del part
    gc.collect()
    assert mine not in file_maps._regions


def test_mapped_torch_file_equals_torch_load(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=g)
    obj = {
        "model": {
            "w": torch.randn(128, 96, generator=g).bfloat16(),
            "b": torch.arange(7, dtype=torch.int64),
            "view": base[3:9, 1:],  # a strided view of a larger storage
            "same": base,
            "empty": torch.empty(0, 4),
            "extra": None,
        },
        "iteration": 3,
        "tags": ["a", 1.5],
    }
    path = tmp_path / "x.pt"
    with open(path, "wb") as f:
        f.write(b"prefix-bytes")
        torch.save(obj, f)
        start = len(b"prefix-bytes")
        length = f.tell() - start
    with open(path, "rb") as f:
        f.seek(start)
        ref = torch.load(f, weights_only=True)
    got = torch_files.load_torch_file(path, start, length, "x.pt")
    assert got.keys() == ref.keys() and got["iteration"] == 3 and got["tags"] == ref["tags"]
    for k, v in ref["model"].items():
        if v is None:
            assert got["model"][k] is None
            continue
        w = got["model"][k]
        assert w.dtype == v.dtype and w.shape == v.shape and w.stride() == v.stride()
        assert torch.equal(w, v)
    # mapped, not copied: the bytes are the file's, and views share their storage as saved
    assert file_maps.file_range(got["model"]["w"].view(torch.uint8).numpy()) is not None
    assert got["model"]["view"].untyped_storage().data_ptr() == (
        got["model"]["same"].untyped_storage().data_ptr()
    )


def test_mapped_torch_file_refuses_objects_and_truncation(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"args": argparse.Namespace(tp=2), "w": torch.ones(3)}, path)  # plain data: read
    assert torch_files.load_torch_file(path, 0, path.stat().st_size, "x.pt")["args"].tp == 2
    torch.save({"bad": collections.Counter(a=1), "w": torch.ones(3)}, path)  # a class not allowed
    with pytest.raises(CheckpointFileError, match="x.pt: refusing collections.Counter"):
        torch_files.load_torch_file(path, 0, path.stat().st_size, "x.pt")
    torch.save({"w": torch.ones(1000)}, path)
    size = path.stat().st_size
    with pytest.raises(CheckpointFileError, match="x.pt: not a torch.save zip archive, or trunc"):
        torch_files.load_torch_file(path, 0, size - 100, "x.pt")


def test_deferred_placeholder_is_written_as_its_parts(blob, tmp_path):
    """``torch.save`` of a placeholder writes the parts' bytes (mapped or not) in its place,
    and the file loads as the concatenation; a partial write falls back to filled memory."""
    from anyspeed.convert.engine import Stacked

    path, _ = blob
    rows = file_maps.map_file(path, 0, 4096 * 30).view(torch.int32).view(-1, 64)  # random bits
    parts = [rows[:10], torch.randint(-9, 9, (3, 64), dtype=torch.int32), rows[300:480]]
    ref = torch.cat(parts)
    ph = mapped.deferred(Stacked(parts))
    assert ph.shape == ref.shape
    out = tmp_path / "t.pt"
    with mapped.FileSink(out) as f:
        torch.save({"w": ph}, f)
    assert torch.equal(torch.load(out, weights_only=True)["w"], ref)
    with mapped.FileSink(tmp_path / "half.bin") as f:
        f.write(ph.view(-1)[:64].numpy())  # a piece of the placeholder
    assert (tmp_path / "half.bin").read_bytes() == ref.view(-1)[:64].numpy().tobytes()
    gc.collect()
    before = len(mapped._deferred)
    del ph
    gc.collect()
    assert len(mapped._deferred) == before - 1


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_lazy_fusion_and_tp_shards_equal_plain_torch(groups):
    """The lazy forms (row views) equal plain ``torch`` math: QKV interleaved per query group
    and split back, SwiGLU's [gate_r; up_r] shards, column shards, and their merges."""
    import dataclasses

    from anyspeed.convert import engine
    from anyspeed.models import get_preset
    from anyspeed.models.families import Fused

    preset = dataclasses.replace(get_preset("tiny-llama3"), num_query_groups=groups)
    heads, d, h = preset.num_attention_heads, preset.head_dim, preset.hidden_size
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n * d, h, generator=g) for n in (heads, groups, groups))
    per = heads // groups
    want = torch.cat([torch.cat([q.view(groups, per * d, h)[i], k.view(groups, d, h)[i],
                                 v.view(groups, d, h)[i]]) for i in range(groups)])  # fmt: skip
    qkv = Fused("qkv", ("q", "k", "v"))
    lazy = engine.fuse_lazy(qkv, [q, k, v], preset)
    assert torch.equal(engine.materialize(lazy), want)
    assert torch.equal(engine.fuse(qkv, [q, k, v], preset), want)
    for part, ref in zip(engine.split_fused(qkv, lazy, preset), (q, k, v), strict=True):
        assert torch.equal(engine.materialize(part), ref)
    gate, up = torch.randn(8, h, generator=g), torch.randn(8, h, generator=g)
    fc1 = engine.Stacked([gate, up])
    for tp in (1, 2, 4):
        shards = [engine.materialize(engine.shard_tp("x.linear_fc1.weight", fc1, tp, r))
                  for r in range(tp)]  # fmt: skip
        for r, s in enumerate(shards):
            assert torch.equal(s, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        assert torch.equal(engine.materialize(engine.merge_tp("x.linear_fc1.weight", shards)),
                           torch.cat([gate, up]))  # fmt: skip
        cols = [engine.materialize(engine.shard_tp("x.linear_qkv.weight", lazy, tp, r))
                for r in range(tp)]  # fmt: skip
        assert torch.equal(torch.cat(cols), want)
        rows = [engine.shard_tp("x.linear_fc2.weight", q, tp, r) for r in range(tp)]
        assert all(torch.equal(a, b) for a, b in zip(rows, q.chunk(tp, dim=1), strict=True))
        assert torch.equal(engine.merge_tp("x.linear_fc2.weight", rows), q)
