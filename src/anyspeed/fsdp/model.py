"""The Hugging Face model of ``anyspeed fsdp2``: checked, loaded, frozen in part, and wrapped
block by block with PyTorch's ``fully_shard`` (the root last), so each rank keeps 1/N of every
parameter, gradient and optimizer state and gathers one block at a time.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.fsdp.config import FSDPConfig

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def read_config(path: str) -> dict[str, Any]:
    """``config.json`` of model directory ``path``; UsageError (one line) for a missing
    directory, remote code (``auto_map``), or an architecture this transformers lacks."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise UsageError(f"model.model_name_or_path {path!r} holds no config.json")
    with open(cfg_file, encoding="utf-8") as f:
        raw = json.load(f)
    if raw.get("auto_map"):
        raise UsageError(
            f"model.model_name_or_path {path!r} needs remote code (config.json has auto_map): "
            "anyspeed fsdp2 trains only models transformers itself defines"
        )
    arch = (raw.get("architectures") or [None])[0]
    import transformers

    if not arch or not hasattr(transformers, arch):
        raise UsageError(
            f"model.model_name_or_path {path!r}: architecture {arch!r} is not in transformers "
            f"{transformers.__version__} (config.json 'architectures')"
        )
    return raw


def model_class(raw: dict[str, Any]) -> Any:
    import transformers

    return getattr(transformers, raw["architectures"][0])


def language_config(config: Any) -> Any:
    """The language model's config of a vision-language config (``text_config``), or itself."""
    return getattr(config, "text_config", None) or config


def is_multimodal(model: torch.nn.Module) -> bool:
    """A vision-language model: its forward takes ``pixel_values``."""
    import inspect

    return "pixel_values" in inspect.signature(model.forward).parameters


def load_model(cfg: FSDPConfig, meta: bool = False) -> torch.nn.Module:
    """The model in fp32 (``meta``: on the meta device, to count it), weights from the
    directory unless ``train_from_scratch`` (then seeded random ones from its config)."""
    m = cfg.model
    raw = read_config(m.model_name_or_path)
    cls = model_class(raw)
    with quiet():
        if meta or m.train_from_scratch:
            config = cls.config_class.from_pretrained(m.model_name_or_path)
            config._attn_implementation = m.attn_implementation
            if meta:
                with torch.device("meta"):
                    return cls._from_config(config, torch_dtype=torch.float32)
            torch.manual_seed(cfg.training.seed)
            model = cls._from_config(config, torch_dtype=torch.float32)
        else:
            model = cls.from_pretrained(
                m.model_name_or_path,
                torch_dtype=torch.float32,
                attn_implementation=m.attn_implementation,
            )
    return model


class quiet:
    """transformers' notices at error level and its progress bars off while a model is read
    or written: anyspeed prints its own lines."""

    def __enter__(self) -> None:
        from transformers.utils import logging

        self.level = logging.get_verbosity()
        self.bars = logging.is_progress_bar_enabled()
        logging.set_verbosity_error()
        logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging

        logging.set_verbosity(self.level)
        if self.bars:
            logging.enable_progress_bar()


def freeze(model: torch.nn.Module, names: tuple[str, ...]) -> int:
    """Stop gradients of every parameter under the modules ``names``; how many were frozen.
    UsageError for a name that is no module of the model."""
    modules = dict(model.named_modules())
    count = 0
    for name in names:
        if name not in modules:
            near = [n for n in modules if n.endswith(name.split(".")[-1])][:3]
            raise UsageError(
                f"model.freeze: {name!r} is no module of the model"
                + (f" (modules named like it: {', '.join(near)})" if near else "")
            )
        for p in modules[name].parameters():
            p.requires_grad_(False)
            count += p.numel()
    return count


def _pattern(text: str) -> re.Pattern[str]:
    """``model.layers.{*}`` (MindSpeed's notation) as a regular expression of module names."""
    return re.compile(re.escape(text).replace(re.escape("{*}"), r"\d+") + r"\Z")


def blocks(model: torch.nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The modules to shard one by one: those ``patterns`` name, else every module whose class
    the model lists in ``_no_split_modules`` (its decoder layers and vision blocks)."""
    named = [(n, m) for n, m in model.named_modules() if n]
    if patterns:
        regs = [_pattern(p) for p in patterns]
        picked = [(n, m) for n, m in named if any(r.match(n) for r in regs)]
        if not picked:
            raise UsageError(
                f"parallel.fsdp_modules {list(patterns)} names no module of the model "
                f"(e.g. {named[1][0] if len(named) > 1 else named[0][0]})"
            )
        return picked
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    picked = [(n, m) for n, m in named if type(m).__name__ in kinds]
    if not picked:
        raise UsageError(
            "the model names no blocks to shard (_no_split_modules is empty): "
            "list them in parallel.fsdp_modules"
        )
    return picked


def shard(model: torch.nn.Module, cfg: FSDPConfig, mesh: Any) -> list[str]:
    """Wrap the blocks (the deepest first) and then the root with ``fully_shard``; activation
    checkpointing of each block first when ``parallel.recompute``. The wrapped names."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    p = cfg.parallel
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPE[p.param_dtype], reduce_dtype=DTYPE[p.reduce_dtype]
    )
    extra: dict[str, Any] = {"mp_policy": policy}
    if p.cpu_offload:
        extra["offload_policy"] = CPUOffloadPolicy()
    picked = blocks(model, p.fsdp_modules)
    if p.recompute:
        _checkpoint_blocks(model, [n for n, _ in picked])
        picked = blocks(model, p.fsdp_modules)
    for _, module in sorted(picked, key=lambda nm: -nm[0].count(".")):
        fully_shard(module, mesh=mesh, reshard_after_forward=p.reshard_after_forward, **extra)
    fully_shard(model, mesh=mesh, reshard_after_forward=p.reshard_after_forward, **extra)
    return [n for n, _ in picked]


def _checkpoint_blocks(model: torch.nn.Module, names: list[str]) -> None:
    """Recompute each block's activations in backward (non-reentrant checkpointing): the
    block's forward is wrapped in place, so its parameters and names stay as they were."""
    from torch.utils.checkpoint import checkpoint

    modules = dict(model.named_modules())
    for name in names:
        block = modules[name]
        forward = block.forward

        def run(*args: Any, _f: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _f(*args, **kwargs)
            return checkpoint(_f, *args, use_reentrant=False, **kwargs)

        block.forward = run
