"""LoRA checks that run inside a spawned rank (importable by name for spawn)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def zero_b_logits(preset: str, targets: list[str], r: int, tokens) -> dict:
    """Logits of a random GPTModel before and after adding zero-B adapters, and the trainable
    parameter count after."""
    import torch

    from anyspeed.distributed.groups import init_distributed
    from anyspeed.inference.logits import forward_logits
    from anyspeed.layout import Layout
    from anyspeed.models import get_preset, gpt
    from anyspeed.training.lora import apply_lora

    init_distributed(Layout(), seed=0)
    model = get_preset(preset)
    chunk = gpt.build(model, gpt.transformer_config(model, Layout()))
    before = forward_logits([chunk], tokens)
    apply_lora(chunk, targets, r=r, alpha=2 * r)
    after = forward_logits([chunk], tokens)
    trainable = sum(p.numel() for p in chunk.parameters() if p.requires_grad)
    names = sorted(n for n, p in chunk.named_parameters() if p.requires_grad)
    base_names = sorted(n for n, _ in chunk.named_parameters() if ".lora_" not in n)
    with torch.no_grad():
        for n, p in chunk.named_parameters():
            if n.endswith("lora_B"):
                p.normal_()
    moved = forward_logits([chunk], tokens)
    return {
        "before": before,
        "after": after,
        "moved": moved,
        "trainable": trainable,
        "names": names,
        "base_names": base_names,
    }


def trained_logits(cli: list[str], tokens) -> object:
    """Logits of the model ``anyspeed posttrain CLI`` resumes (base + adapters, no step run)."""
    from anyspeed.inference.logits import forward_logits
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train

    args, _ = prepare(cli, command="posttrain")
    history = train(args, task_for(args))
    return forward_logits(history["trainer"].model, tokens)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A one-process gloo group and Megatron's parallel state (TP1/PP1), in this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from anyspeed import adaptor

    adaptor.apply(argv=[])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def adapted_chunk(
    base: str, targets: list[str], r: int, alpha: float, grouped: bool, b_std: float
) -> tuple:
    """(the model of the Megatron checkpoint ``base`` with adapters whose B is drawn at random,
    its ModelConfig). ``grouped``: a MoE model's experts as one ``GroupedMLP``. Call inside
    :func:`one_rank`."""
    import dataclasses
    from pathlib import Path

    import torch
    from megatron.core import dist_checkpointing

    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig, gpt
    from anyspeed.training.lora import apply_lora

    tracked = (Path(base) / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = Path(base) / (tracked if tracked == "release" else f"iter_{int(tracked):07d}")
    common = torch.load(it_dir / "common.pt", weights_only=False)
    model = ModelConfig.from_dict(common["anyspeed_model"])
    model = dataclasses.replace(model, moe_grouped_gemm=grouped)
    chunk = gpt.build(model, gpt.transformer_config(model, Layout()))
    loaded = dist_checkpointing.load({"model": chunk.sharded_state_dict()}, str(it_dir))
    chunk.load_state_dict(loaded["model"])
    apply_lora(chunk, targets, r=r, alpha=alpha, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in chunk.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
    return chunk, model


def adapter_checkpoint(
    base: str,
    out: str,
    targets: list[str],
    r: int,
    alpha: float,
    tokens,
    grouped: bool = False,
    b_std: float = 0.05,
):
    """A LoRA checkpoint as ``anyspeed posttrain`` saves one, without training: the model of
    :func:`adapted_chunk`, saved to ``out`` with the adapters view; returns base + adapters'
    logits. ``b_std``: the spread of B's entries. Runs in this process, in :func:`one_rank`."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from anyspeed.inference.logits import forward_logits
    from anyspeed.models.lora import LoraRecord

    with one_rank():
        chunk, model = adapted_chunk(base, targets, r, alpha, grouped, b_std)
        logits = forward_logits([chunk], tokens)
        chunk.lora_view = "adapters"
        record = LoraRecord.of(r, alpha, targets).to_common()
        state = {
            "model": chunk.sharded_state_dict(),
            "iteration": 1,
            "checkpoint_version": 3.0,
            "anyspeed_model": model.to_dict(),
            **record,
        }
        Path(out, "iter_0000001").mkdir(parents=True)
        dist_checkpointing.save(state, str(Path(out, "iter_0000001")))
    Path(out, "latest_checkpointed_iteration.txt").write_text("1")
    return logits


def folded_logits(base: str, targets: list[str], tokens, grouped: bool) -> dict:
    """Logits of :func:`adapted_chunk` (r 4, alpha 8), then after ``fold_adapters`` folded its
    adapters into the weights; whether any adapter, hook or view is left. Runs in this
    process, in :func:`one_rank`."""
    from anyspeed.inference.logits import forward_logits
    from anyspeed.training.lora_fold import fold_adapters

    with one_rank():
        chunk, _ = adapted_chunk(base, targets, 4, 8.0, grouped, 0.5)
        adapted = forward_logits([chunk], tokens)
        n = fold_adapters(chunk)
        folded = forward_logits([chunk], tokens)
        left = [k for k in chunk.state_dict() if ".lora_" in k]
        hooks = sum(len(m._forward_hooks) for m in chunk.modules())
    return {"adapted": adapted, "folded": folded, "n": n, "left": left, "hooks": hooks,
            "view": "lora_view" in chunk.__dict__}  # fmt: skip
