"""A checkpoint's directory, format and non-tensor state, read without trusting the files.

One place answers "where is the checkpoint under this path" (:func:`tracked_dir`,
:func:`checkpoint_dir`), "which layout is it" (:func:`checkpoint_format`: torch_dist or
Megatron-LM's legacy rank files) and "what does it record" (:func:`read_common`,
:func:`read_metadata`, :func:`read_rng`). Every pickle goes through :mod:`anyspeed.safe_pickle`;
every failure is one :class:`CheckpointFileError` line naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from anyspeed import safe_pickle
from anyspeed.checkpoint.errors import CheckpointFileError, first_line
from anyspeed.checkpoint.files import RANK_DIR, TRACKER, iteration_dir, legacy_ranks, read_tracker
from anyspeed.checkpoint.torch_files import load_torch_file, weights_only_load

RNG_KEYS = ("torch", "numpy_keys", "numpy_pos", "python")


def tracked_dir(root: str | os.PathLike[str]) -> str | None:
    """The iteration directory the tracker of ``root`` names (None: no tracker); a tracker
    naming a directory that is not there is a CheckpointFileError."""
    try:
        it = read_tracker(root)
    except ValueError as exc:
        raise CheckpointFileError(str(exc)) from None
    if it is None:
        return None
    path = iteration_dir(root, it)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        return path + ".old"  # killed while replacing it: the previous copy is whole
    if not os.path.isdir(path):
        raise CheckpointFileError(
            f"{TRACKER} names {it!r} but {path} does not exist (a run stopped before saving "
            "it?); point the tracker at an existing iter_* directory"
        )
    return path


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The directory holding the checkpoint itself: the one ``path``'s tracker names, else
    ``path`` (an iteration directory given directly)."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointFileError(f"{d}: no such checkpoint directory")
    tracked = tracked_dir(d)
    return Path(tracked) if tracked is not None else d


def checkpoint_format(it_dir: str | os.PathLike[str]) -> str:
    """``torch_dist`` (Megatron's dist_checkpointing), ``fsdp_dtensor`` (a Megatron-FSDP run's,
    :mod:`anyspeed.checkpoint.fsdp_dtensor`) or ``legacy`` (``mp_rank_*`` files)."""
    d = Path(it_dir)
    if (d / "metadata.json").is_file():
        try:
            backend = json.loads((d / "metadata.json").read_text()).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            backend = None  # reported by the checks that read it
        return "fsdp_dtensor" if backend == "fsdp_dtensor" else "torch_dist"
    if (d / ".metadata").is_file():  # Megatron-LM's --ckpt-format fsdp_dtensor (DCP alone)
        return "fsdp_dtensor"
    if any(RANK_DIR.match(p.name) for p in d.iterdir()):
        return "legacy"
    raise CheckpointFileError(f"{d}: neither a torch_dist nor a legacy (mp_rank_*) checkpoint")


def within(it_dir: str | os.PathLike[str], name: str) -> str:
    """``it_dir/name``, refused when a link takes it outside ``it_dir``."""
    path = os.path.join(it_dir, name)
    inside = os.path.realpath(it_dir)
    if os.path.commonpath([inside, os.path.realpath(path)]) != inside:
        raise CheckpointFileError(f"{path} is a link leading outside the checkpoint")
    return path


def torch_load(path: str | os.PathLike[str]) -> Any:
    """A ``torch.save`` file, plain data only (:mod:`anyspeed.safe_pickle`), its tensors views
    of the mapped file (a pre-1.6 non-zip file is read into memory)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointFileError(f"{path} is missing")
    try:
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"
        if not is_zip:
            return weights_only_load(path, str(path))
        return load_torch_file(path, 0, path.stat().st_size, str(path))
    except OSError as exc:
        raise CheckpointFileError(f"{path}: {first_line(exc)}") from None


def read_common(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The non-tensor state of the checkpoint under ``path`` (a tracker's directory or the
    iteration directory itself), torch_dist's ``common.pt`` or a legacy rank file's."""
    it_dir = checkpoint_dir(path)
    if not (it_dir / "common.pt").exists() and checkpoint_format(it_dir) == "fsdp_dtensor":
        return _dcp_objects(it_dir)
    if checkpoint_format(it_dir) != "legacy":
        file = Path(within(it_dir, "common.pt"))
        common = torch_load(file)
    else:
        file = legacy_ranks(it_dir, False).get((0, 0, 0))  # named alike in every layout
        if file is None:
            raise CheckpointFileError(f"{it_dir}: no mp_rank_00 rank file")
        common = torch_load(file)
        common = (
            {k: v for k, v in common.items() if k != "model"}
            if isinstance(common, dict)
            else common
        )
    if not isinstance(common, dict):
        raise CheckpointFileError(f"{file}: not a checkpoint's common state")
    return common


def _dcp_objects(it_dir: Path) -> dict[str, Any]:
    """The top-level plain objects (args, iteration, ...) a DCP checkpoint holds beside its
    tensors: Megatron-LM's ``fsdp_dtensor`` keeps its common state so."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = read_metadata(it_dir)
    out = {}
    for index, info in meta.storage_data.items():
        key = index.fqn
        if "." in key or not isinstance(meta.state_dict_metadata.get(key), BytesStorageMetadata):
            continue
        file = within(it_dir, os.fspath(info.relative_path))
        out[key] = load_torch_file(file, int(info.offset), int(info.length), f"{file} ({key})")
    return out


def read_metadata(it_dir: str | os.PathLike[str]) -> Any:
    """A torch_dist checkpoint's ``.metadata`` (torch.distributed.checkpoint ``Metadata``)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(it_dir) / ".metadata"
    if not path.is_file():
        raise CheckpointFileError(f"{it_dir}: no .metadata (not a complete torch_dist checkpoint)")
    try:
        meta = safe_pickle.load(path)
    except safe_pickle.UnsafePickleError as exc:
        raise CheckpointFileError(str(exc)) from None
    except OSError as exc:
        raise CheckpointFileError(f"{path}: {first_line(exc)}") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise CheckpointFileError(f"{path}: not torch.distributed.checkpoint metadata")
    return meta


def read_rng(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One rank's saved RNG state (plain data only); CheckpointFileError otherwise."""
    try:
        state = weights_only_load(path, os.fspath(path))
    except OSError as exc:
        raise CheckpointFileError(f"{path}: {first_line(exc)}") from None
    if not isinstance(state, dict) or any(k not in state for k in RNG_KEYS):
        raise CheckpointFileError(f"{path}: not an RNG state (expected {', '.join(RNG_KEYS)})")
    return state
