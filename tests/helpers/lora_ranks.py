"""LoRA checks that run inside a spawned rank (importable by name for spawn)."""

from __future__ import annotations


def zero_b_logits(preset: str, targets: list[str], r: int, tokens) -> dict:
    """Logits of a random GPTModel before and after adding zero-B adapters, and the trainable
    parameter count after."""
    import torch

    from anyspeed.inference.logits import forward_logits
    from anyspeed.layout import Layout
    from anyspeed.models import get_preset, gpt
    from anyspeed.training.distributed import init_distributed
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
    from anyspeed.training.engine import train
    from anyspeed.training.prepare import prepare

    args, _ = prepare(cli, command="posttrain")
    history = train(args)
    return forward_logits(history["trainer"].model, tokens)
