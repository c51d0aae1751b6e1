"""Hostile Hugging Face directories: every safetensors header is checked in full before any
tensor is read, and ``weight_map`` never leads out of the directory. Each bad file is one
ConvertError line naming it; nothing is read outside the file's data section.

All checks run before Megatron starts, so these run in the test process.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

from anyspeed.convert import ConvertError, hf_to_megatron, megatron_to_hf
from anyspeed.convert.hf_io import INDEX, HFCheckpoint
from anyspeed.convert.safetensors_check import read_header
from helpers import convert_ranks


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """A tiny model in one ``model.safetensors`` (test_convert_errors' is sharded)."""
    models = tmp_path_factory.mktemp("hostile")
    convert_ranks.tiny_hf_model(models / "one", "tiny-llama3")
    return models / "one"


@pytest.fixture
def hf(hf_model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_model, tmp_path / "hf"))


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(path: Path, header: dict | list, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _refused(d: Path, match: str, tmp_path: Path) -> str:
    """The conversion of ``d`` fails with one line matching ``match`` and writes nothing."""
    out = tmp_path / "mg"
    with pytest.raises(ConvertError, match=match) as info:
        hf_to_megatron(d, out, ckpt_format="legacy")
    assert "\n" not in str(info.value)
    assert not out.exists() and not list(tmp_path.glob(".mg.partial-*"))
    return str(info.value)


def _set(name: str, field: str, value):
    def edit(header: dict, data: bytes) -> tuple[dict, bytes]:
        header[name][field] = value
        return header, data

    return edit


def _offsets_of(name: str, other: str):
    """``name`` takes ``other``'s bytes (same size): two tensors share them."""

    def edit(header: dict, data: bytes) -> tuple[dict, bytes]:
        header[name]["data_offsets"] = header[other]["data_offsets"]
        return header, data

    return edit


NORM, LN = "model.norm.weight", "model.layers.0.input_layernorm.weight"


@pytest.mark.parametrize("edit, match", [
    # A negative begin reads the JSON header as weights; the case.
    (_set(NORM, "data_offsets", [-256, 0]), r"model.norm.weight' has data_offsets \[-256, 0\]"),
    (_offsets_of(NORM, LN), "overlap"),
    (_set(NORM, "data_offsets", [10**9, 10**9 + 256]), "truncated: tensor 'model.norm.weight'"),
    (_set(NORM, "dtype", ["F32"]), r"unknown dtype \['F32'\]"),
    (_set(NORM, "dtype", "F8_E4M3"), "holds 256 bytes; shape \\[64\\] of F8_E4M3 needs 64"),
    (_set(NORM, "shape", [-64]), "not a list of sizes >= 0"),
    (_set(NORM, "shape", [2**62, 2**62]), "needs more bytes than the file holds"),
    (lambda h, d: ([1, 2], d), r"bad header \(not a JSON object\)"),
    (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), "__metadata__ is not an object"),
    (lambda h, d: (h, d[:-100]), "truncated"),
])  # fmt: skip
def test_bad_header_entries_are_refused_before_reading(hf, tmp_path, edit, match):
    path = hf / "model.safetensors"
    _join(path, *edit(*_split(path)))
    msg = _refused(hf, match, tmp_path)
    assert str(path) in msg


@pytest.mark.parametrize("length", [2**63, 10**11, 2**64 - 1, 100_000_001])
def test_header_length_beyond_the_file_or_cap(hf, tmp_path, length):
    """2**63 gave OverflowError, 1e11 MemoryError: now one line, nothing allocated."""
    path = hf / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", length) + raw[8:])
    _refused(hf, f"header length {length}, file size {len(raw)}", tmp_path)


def _sharded(d: Path, shard: Path, value: str) -> None:
    """Give ``d`` an index whose weight_map points each of ``shard``'s tensors at ``value``."""
    header, _ = _split(shard)
    names = [k for k in header if k != "__metadata__"]
    (d / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(names, value)}))


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABS", "/etc/passwd", "sub/../x",
                                   "", ".", "link"])  # fmt: skip
def test_weight_map_cannot_leave_the_directory(hf, tmp_path, where):
    outside = tmp_path / "outside.safetensors"
    shutil.move(hf / "model.safetensors", outside)  # a valid file, only outside the directory
    if where == "ABS":
        where = str(outside)
    if where == "link":
        (hf / "link").symlink_to(outside)
    _sharded(hf, outside, where)
    msg = _refused(hf, "weight_map names|outside", tmp_path)
    assert msg.startswith(str(hf)) and ("refused" in msg)


def test_side_files_linking_out_of_hf_cfg_dir_are_not_copied(hf, tmp_path):
    """mg -> hf copies --hf-cfg-dir's tokenizer files: a link there to a file elsewhere would
    have copied that file into the output."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    legacy = hf_to_megatron(hf, tmp_path / "legacy", ckpt_format="legacy")
    (hf / "tokenizer.model").symlink_to(secret)
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match="tokenizer.model: a link to .*secret.txt, outside"):
        megatron_to_hf(legacy, out, hf)
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_hub_cache_snapshot_links_to_its_blobs_are_read(hf_model, tmp_path):
    """transformers' cache keeps files in ``blobs/`` and links them from ``snapshots/<rev>/``:
    that one way out of the directory is allowed (it is how downloaded models look)."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in hf_model.iterdir():
        shutil.copy(f, blobs / f"blob-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob-{f.name}")
    ck = HFCheckpoint(snap)
    ref = HFCheckpoint(hf_model)
    assert torch.equal(ck.get(NORM), ref.get(NORM))


def test_every_shard_header_is_checked_before_any_tensor(hf_model, tmp_path):
    """A shard whose tensors the conversion would read last still fails at open."""
    d = tmp_path / "sharded"
    convert_ranks.tiny_hf_model(d, "tiny-llama3", shard="40KB")
    last = sorted(d.glob("*.safetensors"))[-1]
    header, data = _split(last)
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [-8, header[name]["data_offsets"][1] - 8]
    _join(last, header, data)
    with pytest.raises(ConvertError, match=f"{last.name}: tensor '{name}' has data_offsets"):
        HFCheckpoint(d)


# ------------------------------------------------------------------------------------ fuzzing
_HOSTILE = [-1, 0, 1, 7, 2**31, 2**63, 2**64, 10**11, 1.5, True, None, "F32", "x" * 300, [],
            [0], [1], [-3, 5], [5, 3], [0, 2**64], [0.0, 4.0], [[1]], {"a": 1}]  # fmt: skip


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    """One random mutation of a valid safetensors file: its bytes, its length prefix, or one
    field of its JSON header set to a hostile value."""
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    kind = rng.randrange(8)
    if kind == 0:  # a few bytes anywhere in the header (or just past it)
        out = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(min(len(raw), 8 + n + 16))] = rng.randrange(256)
        return bytes(out)
    if kind == 1:
        return raw[: rng.randrange(len(raw))]
    if kind == 2:
        length = rng.choice([0, 1, 2, n - 1, n + 1, len(raw), 2**63, 2**64 - 1, 10**11])
        return struct.pack("<Q", length) + raw[8:]
    if kind == 3:  # one field of one entry
        entry = header[rng.choice(names)]
        entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(_HOSTILE)
    elif kind == 4:  # offsets shifted, or another tensor's
        a, b = rng.sample(names, 2)
        shift = rng.choice([-n - 8, -8, -1, 1, len(data)])
        offs = header[b]["data_offsets"] if rng.random() < 0.5 else header[a]["data_offsets"]
        header[a]["data_offsets"] = [x + shift * (rng.random() < 0.5) for x in offs]
    elif kind == 5:
        header[rng.choice(["__metadata__", rng.choice(names)])] = rng.choice(_HOSTILE)
    elif kind == 6:  # a valid file laid out otherwise: tensors in another order, maybe gaps
        chunks, at = [], 0
        for name in rng.sample(names, len(names)):
            b, e = header[name]["data_offsets"]
            gap = bytes(rng.choice([0, 0, 3]))
            chunks += [gap, data[b:e]]
            header[name]["data_offsets"] = [at + len(gap), at + len(gap) + e - b]
            at += len(gap) + e - b
        data = b"".join(chunks)
    else:
        header = rng.choice(_HOSTILE)
    text = json.dumps(header).encode() + b" " * rng.randrange(8)
    return struct.pack("<Q", len(text)) + text + data


def _reference(path: Path) -> dict[str, torch.Tensor] | None:
    """The tensors the safetensors library reads, or None when it refuses the file."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception:  # any refusal; the library does not crash the process
        return None


def test_fuzzed_headers_are_one_line_or_read_inside_the_file(tmp_path):
    """Random mutations of a valid file (fixed seed): each is refused with one line naming the
    file, or read with every tensor inside the data section, disjoint, and equal to the bytes
    there; whatever the safetensors library itself reads, anyspeed reads the same."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g).half(),
               "c": torch.arange(6).reshape(2, 3), "d": torch.empty(0, 2),
               "e": torch.randn(3, generator=g).bfloat16()}  # fmt: skip
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    path = d / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    valid = path.read_bytes()
    rng = random.Random(0)
    outcomes = {"refused": 0, "read": 0, "library reads": 0}
    for _ in range(400):
        raw = _mutate(valid, rng)
        path.write_bytes(raw)
        ref = _reference(path)
        outcomes["library reads"] += ref is not None
        try:
            ck = HFCheckpoint(d)
            got = {n: (ck.get(n), ck.get(n, mapped=True)) for n in ck.names}
        except ConvertError as exc:
            msg = str(exc)
            assert "\n" not in msg and len(msg) < 400 and msg.startswith(str(d)), msg
            if "unsupported dtype" not in msg:  # a valid file of a dtype the converter lacks
                assert ref is None, f"the safetensors library reads a file refused: {msg}"
            outcomes["refused"] += 1
            continue
        outcomes["read"] += 1
        start, entries = read_header(path)
        spans = sorted((e.begin, e.end) for e in entries.values() if e.end > e.begin)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))
        for name, (t, m) in got.items():
            e = entries[name]
            assert 8 <= start <= start + e.begin <= start + e.end <= len(raw)
            want = raw[start + e.begin : start + e.end]
            for x in (t, m):
                assert x.reshape(-1).view(torch.uint8).numpy().tobytes() == want
                if ref is not None:
                    assert torch.equal(x, ref[name])
    # Both outcomes are exercised (seed 0: 337 refused, 63 read, 12 of them by the library too).
    assert outcomes["refused"] > 200 and outcomes["read"] > 40, outcomes
    assert outcomes["library reads"] > 5, outcomes
