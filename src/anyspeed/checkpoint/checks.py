"""The checkpoint under ``--load``, checked without trusting it before any process group starts,
and one line saying which file broke when a load or save fails anyway.

A ``torch_dist`` checkpoint is read here only through :mod:`anyspeed.safe_pickle`'s restricted
unpickler (``.metadata``, ``common.pt``, the RNG files: plain data only). Every data file the
metadata points into must exist inside the directory (no ``..``, no link leading out) and hold
the bytes the metadata records; the global shapes must be those of the model the flags describe (a
difference names the flag and the checkpoint's value).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

from anyspeed.checkpoint.errors import CheckpointFileError, first_line
from anyspeed.checkpoint.files import RELEASE
from anyspeed.checkpoint.reads import (
    checkpoint_format,
    read_common,
    read_metadata,
    read_rng,
    tracked_dir,
    within,
)
from anyspeed.checkpoint.torch_files import load_torch_file
from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig


def _check_format(it_dir: str) -> None:
    path = os.path.join(it_dir, "metadata.json")
    if not os.path.isfile(path):
        raise CheckpointFileError(
            f"{path} is missing: not a torch_dist checkpoint (anyspeed pretrain loads torch_dist; "
            "anyspeed convert writes it from other formats)"
        )
    try:
        with open(path) as fh:
            backend = json.load(fh).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointFileError(f"{path}: unreadable ({exc})") from None
    if backend not in ("torch_dist", "fsdp_dtensor"):
        raise CheckpointFileError(f"{path}: sharded_backend {backend!r}, expected 'torch_dist'")


def _check_data_files(it_dir: str, meta: Any) -> None:
    """Each file the metadata points into lies in ``it_dir`` and holds the recorded bytes."""
    need: dict[str, int] = {}
    for info in meta.storage_data.values():
        rel = os.fspath(info.relative_path)
        if os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] == "..":
            raise CheckpointFileError(f"{it_dir}/.metadata points outside the checkpoint ({rel!r})")
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        path = within(it_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointFileError(f"{path} is missing (the checkpoint's .metadata lists it)")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointFileError(
                f"{path} is truncated: {size} bytes, the checkpoint's .metadata records data "
                f"up to byte {end}"
            )


def verify(it_dir: str) -> tuple[Any, dict[str, Any]]:
    """The metadata and common state of a torch_dist checkpoint whose files all check out."""
    for name in ("metadata.json", ".metadata", "common.pt"):
        within(it_dir, name)
    _check_format(it_dir)
    meta = read_metadata(it_dir)
    _check_data_files(it_dir, meta)
    return meta, read_common(it_dir)


def fsdp_mismatch(it_dir: str, megatron_fsdp: bool, tp: int, weights_only: bool) -> str | None:
    """Why the checkpoint ``it_dir`` and a run with(out) ``--use-megatron-fsdp`` at TP size
    ``tp`` do not go together; None when they do."""
    saved = checkpoint_format(it_dir) == "fsdp_dtensor"
    if saved and not megatron_fsdp:
        return (
            "saved by a --use-megatron-fsdp run: resume it with --use-megatron-fsdp, or convert "
            "it to HF (anyspeed convert --save-model-type hf) to start another layout from it"
        )
    if megatron_fsdp and not saved and not weights_only:
        return (
            "not saved by a --use-megatron-fsdp run: Megatron-FSDP starts from its weights "
            "with --finetune, and resumes only its own checkpoints"
        )
    saved_tp = read_common(it_dir).get("anyspeed_layout", {}).get("tp") if saved else tp
    if saved_tp != tp:
        return (
            f"Megatron-FSDP saved it at --tensor-model-parallel-size {saved_tp}; resume at that "
            "size (any number of data-parallel ranks), or convert it to HF"
        )
    return None


def check_load(
    load_dir: str, layout: Layout, dp: int, *, finetune: bool = False, load_rng: bool = True
) -> None:
    """Every file the load of ``load_dir`` reads is there, whole and readable (one
    CheckpointFileError line otherwise). The RNG files (restored only at the saved ``layout``
    and ``dp`` size, without ``finetune``) are read once, by the launcher or a lone process:
    ranks started by torchrun, which would each read all of them, leave them to the load,
    where a bad one stops every rank alike."""
    it_dir = tracked_dir(load_dir)
    if it_dir is None:
        return
    _, common = verify(it_dir)
    weights_only = finetune or os.path.basename(it_dir) == RELEASE
    mismatch = fsdp_mismatch(it_dir, layout.megatron_fsdp, layout.tp, weights_only)
    if mismatch:
        raise CheckpointFileError(mismatch)
    rng_dir = os.path.join(it_dir, "anyspeed_rng")
    if finetune or not load_rng or os.path.basename(it_dir) == RELEASE:
        return
    now = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "dp": dp}
    restored = common.get("anyspeed_layout") == now and os.path.isdir(rng_dir)
    if restored and "RANK" not in os.environ:
        for name in sorted(os.listdir(rng_dir)):
            read_rng(within(it_dir, os.path.join("anyspeed_rng", name)))


# ------------------------------------------------------------------------------ architecture
_LAYER = "decoder.layers."


def _shapes(meta: Any) -> dict[str, tuple[int, ...]]:
    """Global shapes by key. A MoE model keys each layer apart (``decoder.layers.3.…``); those
    are folded into the layer-stacked form a dense model saves, so one set of checks reads both."""
    shapes = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}
    if any(k.startswith("model.") for k in shapes):  # a Megatron-FSDP run's (fsdp_dtensor)
        shapes = {k[len("model.") :]: v for k, v in shapes.items() if k.startswith("model.")}
    per_layer: dict[str, list[tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = re.match(r"decoder\.layers\.\d+\.", key)
        if m:
            per_layer.setdefault(_LAYER + key[m.end() :], []).append(shape)
    for key, found in per_layer.items():
        shapes.setdefault(key, (len(found), *found[0]))
    return shapes


def _dim(shapes: dict[str, tuple[int, ...]], key: str, i: int) -> int | None:
    shape = shapes.get(key)
    return shape[i] if shape is not None and -len(shape) <= i < len(shape) else None


def _differences(
    cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]
) -> list[tuple[str, Any, Any]]:
    """(flag, this run's value, the checkpoint's value) for each architecture flag the
    checkpoint's global shapes contradict, in the flag table's order."""
    attn = _LAYER + "self_attention."
    proj, qkv = attn + "linear_proj.weight", attn + "linear_qkv"
    fc1, fc2 = _LAYER + "mlp.linear_fc1.weight", _LAYER + "mlp.linear_fc2.weight"
    emb = "embedding.word_embeddings.weight"
    experts = _LAYER + "mlp.experts.experts.linear_fc2.weight"  # [layers, experts, h, ffn]
    d = cfg.head_dim
    q_width = _dim(shapes, proj, 2)
    rows = _dim(shapes, qkv + ".weight", 1)
    groups = None
    if rows is not None and q_width == cfg.num_attention_heads * d and rows % d == 0:
        groups = (rows // d - cfg.num_attention_heads) // 2
    ffn = _dim(shapes, fc2, 2)
    fc1_rows = _dim(shapes, fc1, 1)
    swiglu = None if ffn is None or fc1_rows is None else fc1_rows == 2 * ffn
    checks = [
        ("--num-layers", cfg.num_layers, _dim(shapes, proj, 0)),
        ("--hidden-size", cfg.hidden_size, _dim(shapes, emb, 1)),
        ("--num-attention-heads x --kv-channels", cfg.num_attention_heads * d, q_width),
        ("--num-query-groups", cfg.num_query_groups, groups),
        ("--ffn-hidden-size", cfg.ffn_hidden_size, ffn),
        ("--swiglu or --quick-geglu", cfg.gated, swiglu),
        ("--disable-bias-linear", not cfg.add_bias_linear, attn + "linear_proj.bias" not in shapes),
        ("--add-qkv-bias", cfg.add_qkv_bias or cfg.add_bias_linear, qkv + ".bias" in shapes),
        ("--qk-layernorm", cfg.qk_layernorm, attn + "q_layernorm.weight" in shapes),
        (
            "--untie-embeddings-and-output-weights",
            not cfg.tie_embeddings,
            None
            if "output_layer.score.weight" in shapes  # a reward model: no vocab projection
            else "output_layer.weight" in shapes,
        ),
        ("--padded-vocab-size", cfg.vocab_size, _dim(shapes, emb, 0)),
        (
            "--num-experts",
            cfg.num_experts or 0,
            _dim(shapes, experts, 1) if experts in shapes else 0 if fc2 in shapes else None,
        ),
        (
            "--moe-ffn-hidden-size",
            cfg.expert_ffn_size if cfg.is_moe else None,
            _dim(shapes, experts, 3),
        ),
    ]
    return [
        (flag, ours, theirs)
        for flag, ours, theirs in checks
        if theirs is not None and ours != theirs
    ]


def _say(flag: str, ours: Any, theirs: Any) -> str:
    if isinstance(ours, bool):
        return (
            f"the checkpoint was saved {'with' if theirs else 'without'} {flag}, this run "
            f"is {'with' if ours else 'without'} it"
        )
    return f"the checkpoint has {flag} {theirs}, this run has {ours}"


def check_fits(load_dir: str | None, model: ModelConfig) -> None:
    """The global tensor shapes of the checkpoint under ``load_dir`` are those of ``model``;
    else one CheckpointFileError line naming the first flag that differs and the checkpoint's
    value."""
    if not load_dir:
        return
    it_dir = tracked_dir(load_dir)
    if it_dir is None or not os.path.isfile(os.path.join(it_dir, ".metadata")):
        return  # an HF directory (converted from these flags) or nothing to load
    shapes = _shapes(read_metadata(it_dir))
    lm = "language_model."  # a vision-language model (LLaVA): its language model is checked
    if any(k.startswith(lm) for k in shapes):
        shapes = {k[len(lm) :]: v for k, v in shapes.items() if k.startswith(lm)}
    diffs = _differences(model, shapes)
    if diffs:
        raise CheckpointFileError(
            f"{it_dir} holds another architecture: {_say(*diffs[0])} (pass the checkpoint's "
            "architecture flags, or --load a checkpoint of this model)"
        )


# ------------------------------------------------------------------------------ failed loads
def root_cause(exc: BaseException) -> BaseException:
    """The innermost error: through a distributed checkpoint's per-rank failures and causes."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            exc = first[0] if isinstance(first, tuple) else first
            continue
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc


def describe_failure(it_dir: str, exc: BaseException) -> str:
    """One line naming the file of ``it_dir`` that broke a load and the cause: a file check
    first (missing, truncated, unreadable), then each tensor record, else the error itself."""
    try:
        meta, _ = verify(it_dir)
        _check_records(it_dir, meta)
    except CheckpointFileError as found:
        return str(found)
    except Exception:  # noqa: BLE001, S110 - the diagnosis found nothing better to say
        pass
    cause = root_cause(exc)
    return f"{it_dir}: {type(cause).__name__}: {first_line(cause)}"


def _check_records(it_dir: str, meta: Any) -> None:
    """Every tensor record of the data files unpickles (plain data only)."""
    tensors = meta.state_dict_metadata
    for index, info in meta.storage_data.items():
        if not hasattr(tensors.get(index.fqn), "size"):
            continue  # a bytes record
        path = os.path.join(it_dir, os.fspath(info.relative_path))
        what = f"{path} ({index.fqn})"
        try:
            load_torch_file(path, int(info.offset), int(info.length), what)
        except Exception as exc:  # noqa: BLE001 - whatever the damage: one line naming it
            text = first_line(exc)
            text = text if text.startswith(path) else f"{what}: {text}"
            raise CheckpointFileError(text) from None


def describe_save_failure(directory: str, exc: BaseException) -> str:
    """The cause of a failed save in one line: the OS error, or, when a writer hid it behind
    its own (torch's zip writer on a full disk), the error writing 1 MiB to ``directory`` gives."""
    cause = root_cause(exc)
    if isinstance(cause, OSError):
        return first_line(cause)
    path = os.path.join(directory, f".write-probe-{os.getpid()}")
    try:
        with open(path, "wb") as fh:
            fh.write(bytes(2**20))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as probe:
        return f"{first_line(probe)} ({type(cause).__name__}: {first_line(cause)})"
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    return f"{type(cause).__name__}: {first_line(cause)}"
