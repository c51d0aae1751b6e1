"""The YAML configuration of ``anyspeed fsdp2``: four sections whose keys follow
MindSpeed-LLM's FSDP2 configurations (``model``, ``data``, ``parallel``, ``training``), read
into frozen dataclasses, with ``--section.key value`` overrides from the command line.

Every key is known: an unknown one is a one-line error that names it and the keys its section
has, and every value is checked for type and range before any process group starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from anyspeed.errors import UsageError

DTYPES = ("fp32", "bf16", "fp16")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class ModelSection:
    """What to train: a transformers model directory (no remote code)."""

    model_name_or_path: str = ""
    trust_remote_code: bool = False  # anyspeed runs no remote code: True is refused
    train_from_scratch: bool = False  # random weights from the directory's config.json
    attn_implementation: str = "sdpa"  # sdpa | eager
    freeze: tuple[str, ...] = ()  # module names (prefixes) whose parameters do not train


@dataclass(frozen=True)
class DataSection:
    """Where samples come from: a pretraining ``.bin/.idx`` prefix, an instruction dataset
    prefix (``anyspeed preprocess`` output) or a multimodal conversation JSON file."""

    dataset: str = ""
    cutoff_len: int = 1024  # tokens per sample (the sequence length)
    image_dir: str = ""  # images of the multimodal JSON (default: the file's folder)
    image_max_pixels: int = 4096 * 4096  # larger images are refused before decoding
    shuffle: bool = True


@dataclass(frozen=True)
class ParallelSection:
    """How the model is spread: FSDP2 over every rank, Ulysses sequence parallelism inside."""

    fsdp_size: int | str = "auto"  # "auto": world size / cp_size
    cp_size: int = 1  # Ulysses degree for the language model
    cp_type: str = "ulysses"
    fsdp_modules: tuple[str, ...] = ()  # e.g. model.layers.{*}; default: the model's blocks
    reshard_after_forward: bool = True
    param_dtype: str = "fp32"  # what the gathered parameters compute in
    reduce_dtype: str = "fp32"  # what gradients are reduced in
    recompute: bool = False  # activation checkpointing of every wrapped block
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer state on the CPU


@dataclass(frozen=True)
class TrainingSection:
    """The optimizer, the schedule, the batch and what is saved."""

    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    optimizer: str = "adamw"
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = 0.0
    max_steps: int = 0
    seed: int = 42
    output_dir: str = ""  # checkpoints (torch.distributed.checkpoint) and the HF export
    save_steps: int = 0  # 0: only at the end
    resume_from_checkpoint: str = ""  # a checkpoint directory, or "auto": output_dir's latest
    save_hf_weights: bool = True  # write output_dir/hf (a plain transformers directory) at the end
    logging_steps: int = 1
    metrics_file: str = ""
    tensorboard_dir: str = ""
    no_progress_bar: bool = False


@dataclass(frozen=True)
class FSDPConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    training: TrainingSection = field(default_factory=TrainingSection)

    @property
    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


SECTIONS = {f.name: f.type for f in dataclasses.fields(FSDPConfig)}
_CLASSES = {
    "model": ModelSection,
    "data": DataSection,
    "parallel": ParallelSection,
    "training": TrainingSection,
}


# What MindSpeed-MM's, Megatron's and transformers' configurations call some of these keys.
ALIASES = {
    "learning_rate": "lr", "train_iters": "max_steps", "micro_batch_size":
    "per_device_train_batch_size", "clip_grad": "max_grad_norm", "lr_decay_style":
    "lr_scheduler_type", "lr_warmup_ratio": "warmup_ratio", "save_interval": "save_steps",
    "log_interval": "logging_steps", "save": "output_dir", "load": "resume_from_checkpoint",
    "seq_length": "cutoff_len", "fsdp_plan": "fsdp_modules", "ulysses_parallel_size": "cp_size",
    "fully_shard_parallel_size": "fsdp_size", "model_id": "model_name_or_path",
}  # fmt: skip


def _closest(name: str, known: list[str]) -> str:
    if ALIASES.get(name) in known:
        return f" (did you mean {ALIASES[name]!r}?)"
    near = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _coerce(where: str, value: Any, default: Any) -> Any:
    """``value`` as the type of the key's default; UsageError naming ``where`` otherwise."""
    if where.endswith(".fsdp_size"):
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise UsageError(f"{where}: {value!r} is not auto or a positive number of ranks")
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, tuple):
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    kind = type(default).__name__ if not isinstance(default, tuple) else "list of names"
    raise UsageError(f"{where}: {value!r} is not a {kind}")


def _section(name: str, values: Any, where: str) -> Any:
    cls = _CLASSES[name]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UsageError(f"{where}: section {name!r} must be a mapping of keys to values")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known = sorted(fields)
    made = {}
    for key, value in values.items():
        if key not in fields:
            raise UsageError(
                f"{where}: unknown key {name}.{key}{_closest(str(key), known)}; "
                f"{name} has: {', '.join(known)}"
            )
        default = cls().__getattribute__(key)
        made[key] = _coerce(f"{where}: {name}.{key}", value, default)
    return cls(**made)


def parse_overrides(argv: list[str]) -> dict[str, dict[str, Any]]:
    """``--section.key value`` pairs (values read as YAML scalars) into nested dicts."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--") or "." not in flag:
            raise UsageError(f"unrecognized argument {flag!r} (overrides are --section.key VALUE)")
        key = flag[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise UsageError(f"{flag} needs a value")
            raw = argv[i + 1]
            i += 2
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = yaml.safe_load(raw)
    return out


def load(path: str, overrides: dict[str, dict[str, Any]] | None = None) -> FSDPConfig:
    """The configuration in YAML file ``path`` with ``overrides`` applied; UsageError (one line)
    for a missing file, bad YAML, an unknown section or key, or a value of the wrong type."""
    import yaml

    if not os.path.isfile(path):
        raise UsageError(f"config {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        at = f" at line {line + 1}" if line is not None else ""
        raise UsageError(f"config {path!r} is not valid YAML{at}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"config {path!r} must be a mapping of sections (model, data, ...)")
    for section, values in (overrides or {}).items():
        if section in raw and not isinstance(raw[section], dict):
            raise UsageError(f"config {path!r}: section {section!r} must be a mapping")
        raw.setdefault(section, {})
        raw[section] = {**(raw[section] or {}), **values}
    known = list(_CLASSES)
    for section in raw:
        if section not in _CLASSES:
            raise UsageError(
                f"config {path!r}: unknown section {section!r}{_closest(str(section), known)}; "
                f"the sections are: {', '.join(known)}"
            )
    made = {name: _section(name, raw.get(name), f"config {path!r}") for name in _CLASSES}
    cfg = FSDPConfig(**made)
    check_values(cfg, path)
    return cfg


def _range(where: str, ok: bool, need: str) -> None:
    if not ok:
        raise UsageError(f"{where} {need}")


def check_values(cfg: FSDPConfig, path: str) -> None:
    """Ranges and choices of single keys (what needs the world size is in :func:`layout`)."""
    m, d, p, t = cfg.model, cfg.data, cfg.parallel, cfg.training
    at = f"config {path!r}:"
    _range(f"{at} model.model_name_or_path", bool(m.model_name_or_path), "is required")
    _range(f"{at} data.dataset", bool(d.dataset), "is required")
    _range(f"{at} training.max_steps", t.max_steps != 0, "is required (optimizer steps to train)")
    attention_ok = m.attn_implementation in ("sdpa", "eager")
    _range(f"{at} model.attn_implementation", attention_ok, "must be sdpa or eager")
    _range(f"{at} data.cutoff_len", d.cutoff_len >= 2, "must be at least 2")
    _range(f"{at} data.image_max_pixels", d.image_max_pixels > 0, "must be positive")
    _range(f"{at} parallel.cp_size", p.cp_size >= 1, "must be at least 1")
    ulysses = "must be ulysses (the FSDP2 trainer's sequence parallelism is Ulysses)"
    _range(f"{at} parallel.cp_type", p.cp_type == "ulysses", ulysses)
    for key in ("param_dtype", "reduce_dtype"):
        _range(f"{at} parallel.{key}", getattr(p, key) in DTYPES, f"must be one of {DTYPES}")
    _range(f"{at} training.optimizer", t.optimizer == "adamw", "must be adamw")
    schedule_ok = t.lr_scheduler_type in SCHEDULES
    _range(f"{at} training.lr_scheduler_type", schedule_ok, f"must be one of {SCHEDULES}")
    counts = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_steps")
    for key in (*counts, "logging_steps"):
        _range(f"{at} training.{key}", getattr(t, key) >= 1, "must be at least 1")
    for key in ("lr", "min_lr", "weight_decay", "adam_epsilon", "max_grad_norm", "save_steps"):
        _range(f"{at} training.{key}", getattr(t, key) >= 0, "must not be negative")
    _range(f"{at} training.min_lr", t.min_lr <= t.lr, "must not exceed training.lr")
    for key in ("adam_beta1", "adam_beta2", "warmup_ratio"):
        _range(f"{at} training.{key}", 0 <= getattr(t, key) < 1, "must be in [0, 1)")
    if t.resume_from_checkpoint == "auto" or t.save_steps or t.save_hf_weights:
        saves = "is required to save (or set save_hf_weights: false)"
        _range(f"{at} training.output_dir", bool(t.output_dir), saves)


def layout(cfg: FSDPConfig, world: int) -> tuple[int, int]:
    """(FSDP shards, data-parallel replicas of the data) for ``world`` ranks; UsageError when
    ``cp_size`` or ``fsdp_size`` does not divide them."""
    p = cfg.parallel
    if world % p.cp_size:
        raise UsageError(f"parallel.cp_size {p.cp_size} does not divide the {world} ranks")
    dp = world // p.cp_size
    if p.fsdp_size != "auto" and int(p.fsdp_size) != world:
        raise UsageError(
            f"parallel.fsdp_size {p.fsdp_size} must be auto or the {world} ranks (FSDP2 shards "
            "over every rank, the Ulysses ranks included)"
        )
    return world, dp
