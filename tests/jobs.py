"""Functions that run inside spawned ranks (importable by name, so spawn can pickle them)."""

from __future__ import annotations

from anyspeed.training.engine import GPTSpec, Layout, TrainConfig, Trainer


def train_steps(
    layout: dict,
    steps: int = 3,
    save_init: str | None = None,
    load: str | None = None,
    spec: dict | None = None,
) -> list[dict]:
    """Build the tiny GPT at ``layout``, optionally load/save weights, run ``steps`` steps."""
    t = Trainer(GPTSpec(**(spec or {})), Layout(**layout), TrainConfig())
    if save_init:
        t.save_model(save_init)
    if load:
        t.load_model(load)
    return [t.step() for _ in range(steps)]


def attention_class() -> str:
    """Name of the attention core class the GPT is built with (checks which level applied)."""
    t = Trainer(GPTSpec(num_layers=1), Layout(), TrainConfig())
    layer = t.model[0].module.decoder.layers[0]
    return type(layer.self_attention.core_attention).__name__


def train_save_logits(layout: dict, load: str, save: str, tokens) -> object:
    """Load weights, train one step, save with dist_checkpointing, return logits of ``tokens``."""
    t = Trainer(GPTSpec(), Layout(**layout), TrainConfig())
    t.load_model(load)
    t.step()
    t.save_model(save)
    return t.logits(tokens)


def load_logits(layout: dict, load: str, tokens) -> object:
    """Load a dist_checkpointing checkpoint at ``layout`` and return logits of ``tokens``."""
    t = Trainer(GPTSpec(), Layout(**layout), TrainConfig())
    t.load_model(load)
    return t.logits(tokens)


def train_precision(bf16: bool, steps: int, load: str | None = None) -> dict:
    """Train the tiny GPT in bf16 or fp32; report losses and the dtypes the optimizer keeps."""
    t = Trainer(GPTSpec(), Layout(), TrainConfig(bf16=bf16, lr=3e-3))
    if load:
        t.load_model(load)
    losses = [t.step()["loss"] for _ in range(steps)]
    model_dtypes = {str(p.dtype) for p in t.model[0].parameters()}
    opt = t.optimizer
    main = getattr(opt, "fp32_from_float16_groups", None)
    main_dtypes = {
        str(p.dtype)
        for g in (main or opt.optimizer.param_groups)
        for p in (g if main else g["params"])
    }
    return {"losses": losses, "model": sorted(model_dtypes), "main": sorted(main_dtypes)}


def megatron_preset_parameters(name: str) -> int:
    """Parameter count of Megatron's GPTModel built from preset ``name`` (1 process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from anyspeed.models import get_preset
    from anyspeed.models.factory import gpt_model, transformer_config

    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    preset = get_preset(name)
    model = gpt_model(preset, transformer_config(preset))
    return sum(p.numel() for p in model.parameters())
