"""Functions that run inside spawned ranks (importable by name, so spawn can pickle them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.stages.pretrain.task import PretrainTask
from anyspeed.training import synthetic
from anyspeed.training.config import TrainConfig
from anyspeed.training.step import Trainer


def _trainer(layout: dict | None = None, model: dict | None = None, **cfg) -> Trainer:
    return Trainer(
        ModelConfig(**(model or {})), Layout(**(layout or {})), TrainConfig(**cfg), PretrainTask()
    )


def _steps(t: Trainer, steps: int) -> list[dict]:
    return [synthetic.train_step(t) for _ in range(steps)]


def _sharded(t: Trainer) -> dict:
    if len(t.model) == 1:
        return t.model[0].module.sharded_state_dict()
    return {f"model{i}": m.module.sharded_state_dict() for i, m in enumerate(t.model)}


def save_weights(t: Trainer, directory: str) -> None:
    """Save the model weights with Megatron's dist_checkpointing (any layout can load them)."""
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(_sharded(t), directory)


def load_weights(t: Trainer, directory: str) -> None:
    """Load weights saved by :func:`save_weights`, at any layout."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded(t), directory)
    if len(t.model) == 1:
        t.model[0].module.load_state_dict(state)
    else:
        for i, m in enumerate(t.model):
            m.module.load_state_dict(state.get(f"model{i}", {}))  # none: noop slots only
    if hasattr(t.optimizer, "reload_model_params"):
        t.optimizer.reload_model_params()


def logits(t: Trainer, tokens):
    from anyspeed.inference.logits import forward_logits

    return forward_logits(t.model, tokens)


def train_steps(
    layout: dict,
    steps: int = 3,
    save_init: str | None = None,
    load: str | None = None,
    spec: dict | None = None,
) -> list[dict]:
    """Build the tiny GPT at ``layout``, optionally load/save weights, run ``steps`` steps."""
    t = _trainer(layout, spec)
    if save_init:
        save_weights(t, save_init)
    if load:
        load_weights(t, load)
    return _steps(t, steps)


def train_steps_cases(cases: list[dict]) -> list[list[dict]]:
    """:func:`train_steps` for each case (``layout``, ``argv``, ``load``) in one process group:
    the adaptor is re-applied with the case's flags, Megatron's parallel state rebuilt."""
    from anyspeed import adaptor

    out = []
    for case in cases:
        adaptor.undo()
        adaptor.apply(argv=case.get("argv", []))
        out.append(train_steps(case["layout"], load=case.get("load"), spec=case.get("spec")))
    return out


def level_runs(ckpt: str, levels: tuple[str, ...] = ("0", "1")) -> list[tuple[list, str]]:
    """Per ``--optimization-level``: 3 steps from the same initial weights (saved by the first)
    and the attention-core class the GPT is built with, in one process group."""
    from anyspeed import adaptor

    out = []
    for i, level in enumerate(levels):
        adaptor.undo()
        adaptor.apply(argv=["--optimization-level", level])
        steps = train_steps({}, save_init=ckpt) if i == 0 else train_steps({}, load=ckpt)
        out.append((steps, attention_class()))
    return out


def precision_runs(ckpt: str, steps: int) -> dict:
    """fp32 and bf16 training of the same initial weights, in one process group."""
    train_steps({}, steps=0, save_init=ckpt)
    return {"fp32": train_precision(False, steps, ckpt), "bf16": train_precision(True, steps, ckpt)}


def attention_class() -> str:
    """Name of the attention core class the GPT is built with (checks which level applied)."""
    t = _trainer(model=dict(num_layers=1))
    layer = t.model[0].module.decoder.layers[0]
    return type(layer.self_attention.core_attention).__name__


def train_save_logits(layout: dict, load: str, save: str, tokens, spec: dict | None = None):
    """Load weights, train one step, save with dist_checkpointing, return logits of ``tokens``."""
    t = _trainer(layout, spec)
    load_weights(t, load)
    _steps(t, 1)
    save_weights(t, save)
    return logits(t, tokens)


def load_logits(layout: dict, load: str, tokens, spec: dict | None = None) -> object:
    """Load a dist_checkpointing checkpoint at ``layout`` and return logits of ``tokens``."""
    t = _trainer(layout, spec)
    load_weights(t, load)
    return logits(t, tokens)


def train_precision(bf16: bool, steps: int, load: str | None = None) -> dict:
    """Train the tiny GPT in bf16 or fp32; report losses and the dtypes the optimizer keeps."""
    t = _trainer(bf16=bf16, lr=3e-3)
    if load:
        load_weights(t, load)
    losses = [r["loss"] for r in _steps(t, steps)]
    model_dtypes = {str(p.dtype) for p in t.model[0].parameters()}
    opt = t.optimizer
    main = getattr(opt, "fp32_from_float16_groups", None)
    main_dtypes = {
        str(p.dtype)
        for g in (main or opt.optimizer.param_groups)
        for p in (g if main else g["params"])
    }
    return {"losses": losses, "model": sorted(model_dtypes), "main": sorted(main_dtypes)}


def megatron_preset_parameters(names: list[str]) -> dict[str, int]:
    """Parameter count of Megatron's GPTModel built from each preset (1 process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from anyspeed.models import get_preset, gpt

    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    counts = {}
    for name in names:
        preset = get_preset(name)
        model = gpt.build(preset, gpt.transformer_config(preset))
        counts[name] = sum(p.numel() for p in model.parameters())
    return counts


def load_logits_cases(cases: list[dict], load: str, tokens) -> list:
    """:func:`load_logits` for each case (``layout``, ``spec``) in one process group."""
    return [load_logits(c["layout"], load, tokens, c.get("spec")) for c in cases]


def train_eval_save_logits(
    layout: dict, load: str, save: str, tokens, spec: dict | None = None, steps: int = 3, **cfg
) -> dict:
    """Load weights, train ``steps`` steps, evaluate one synthetic batch (forward only), save
    with dist_checkpointing, and return the steps, the eval loss and the logits of ``tokens``
    (None: no logits, e.g. under CP, where the logits pass does not split the sequence)."""
    t = _trainer(layout, spec, **cfg)
    load_weights(t, load)
    history = _steps(t, steps)
    evaluated = t.evaluate(synthetic.microbatches(t.model_config.vocab_size, t.cfg, 99))
    save_weights(t, save)
    out = None if tokens is None else logits(t, tokens)
    return {"steps": history, "eval": evaluated, "logits": out}


def layouts_steps(layouts: list[dict], load: str, spec: dict | None = None, steps: int = 3,
                  **cfg) -> list[list[dict]]:  # fmt: skip
    """Each layout's ``steps`` steps from the weights at ``load``, in one process group, with
    the same TrainConfig changes (``cfg``, e.g. ``bf16=True``)."""
    out = []
    for layout in layouts:
        t = _trainer(layout, spec, **cfg)
        load_weights(t, load)
        out.append(_steps(t, steps))
    return out


def one_process_reference(root: Any, num_layers: int) -> tuple[str, Any, dict]:
    """(initial weights' checkpoint, token ids, result) of one process of ``num_layers``
    layers: its initial weights saved, then 3 steps, eval and the saved checkpoint's logits
    (the reference a placed layout is compared with)."""
    import torch

    from anyspeed.testing import run_distributed

    init, spec = str(Path(root) / "init"), dict(num_layers=num_layers)
    run_distributed(train_steps, 1, layout={}, steps=0, save_init=init, spec=spec, timeout=240)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    (ref,) = run_distributed(train_eval_save_logits, 1, layout={}, load=init,
                             save=str(Path(root) / "ref"), tokens=tokens, spec=spec,
                             timeout=300)  # fmt: skip
    return init, tokens, ref
