"""``anyspeed fsdp2`` tests: tiny random transformers models, the single-process transformers
training loop they are compared with, and the function spawned ranks run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

TEXT = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "decoder_sparse_step": 1, "norm_topk_prob": True},
    ),
    "phi3": (  # LongRoPE past its pretraining length (16), RoPE on 3/4 of each head, a window
        "Phi3Config",
        "Phi3ForCausalLM",
        {"original_max_position_embeddings": 16, "partial_rotary_factor": 0.75,
         "sliding_window": 10, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
         "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                          "long_factor": [1.5, 2.0, 4.0, 8.0, 16.0, 32.0]}},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
         "layer_types": ["sliding_attention", "full_attention"]},
    ),
}  # fmt: skip


def text_model(directory: str | Path, kind: str, vocab: int = 512, seed: int = 0) -> str:
    """A random tiny ``kind`` model (2 layers, hidden 64) saved at ``directory``; its path."""
    import transformers

    cfg_name, cls_name, extra = TEXT[kind]
    config = getattr(transformers, cfg_name)(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    with torch.no_grad():  # norms away from 1, so a wrong weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    return str(directory)


def windows(prefix: str, seq: int, dtype: Any = np.uint16) -> np.ndarray:
    """The corpus's token stream (read straight from the .bin) cut into windows of seq + 1."""
    tokens = np.fromfile(prefix + ".bin", dtype=dtype).astype(np.int64)
    n = (len(tokens) - 1) // seq
    return np.stack([tokens[i * seq : i * seq + seq + 1] for i in range(n)])


def text_batches(prefix: str, seq: int, gbs: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Global batch k of a pretraining corpus: windows ``k*gbs .. (k+1)*gbs`` in order."""
    w = torch.from_numpy(windows(prefix, seq))
    return [
        {"input_ids": w[k * gbs : (k + 1) * gbs, :-1], "labels": w[k * gbs : (k + 1) * gbs, 1:]}
        for k in range(steps)
    ]


def model_class(directory: str) -> Any:
    """The transformers class a saved directory's config.json names."""
    import json

    import transformers

    with open(Path(directory) / "config.json") as f:
        return getattr(transformers, json.load(f)["architectures"][0])


def reference_loop(
    model_dir: str,
    batches: list[dict[str, torch.Tensor]],
    lr: float,
    wd: float,
    clip: float,
    freeze: str = "",
) -> dict[str, Any]:
    """transformers + torch.optim.AdamW in one process, one global batch per step, the loss
    the mean cross entropy over every learned token of the batch (``freeze``: a module that
    does not train)."""
    model = model_class(model_dir).from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    if freeze:
        model.get_submodule(freeze).requires_grad_(False)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad]
    keep = [p for p in model.parameters() if p.dim() < 2 and p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": keep, "weight_decay": 0.0}], lr=lr
    )
    losses, norms = [], []
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
        )
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"loss": losses, "grad_norm": norms, "params": dict(model.named_parameters())}


def write_config(path: str | Path, model_dir: str, dataset: str, **sections: dict) -> str:
    """A YAML configuration: a tiny-run default for each section, updated by ``sections``."""
    import yaml

    cfg = {
        "model": {"model_name_or_path": model_dir},
        "data": {"dataset": dataset, "cutoff_len": 32, "shuffle": False},
        "parallel": {},
        "training": {
            "per_device_train_batch_size": 2,
            "lr": 1e-3,
            "weight_decay": 0.1,
            "lr_scheduler_type": "constant",
            "max_steps": 3,
            "no_progress_bar": True,
            "save_hf_weights": False,
        },
    }
    for name, values in sections.items():
        cfg[name].update(values)
    Path(path).write_text(yaml.safe_dump(cfg))
    return str(path)


def train_rank(
    config: str, overrides: dict | None = None, probe: torch.Tensor | None = None
) -> dict[str, Any]:
    """Run ``anyspeed fsdp2``'s rank body on ``config``; the losses, grad norms, the bytes of
    this rank's parameter shards, and the trained model's logits of ``probe`` tokens."""
    from anyspeed.fsdp.config import load
    from anyspeed.fsdp.run import train

    history = train(load(config, overrides))
    model = history["trainer"].model
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    logits = None
    if probe is not None:
        model.eval()
        with torch.no_grad():
            logits = model(probe, use_cache=False).logits
    return {
        "loss": history["loss"],
        "grad_norm": history["grad_norm"],
        "local_bytes": local,
        "logits": logits,
    }


def load_params(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of an exported directory (read by transformers itself)."""
    model = model_class(directory).from_pretrained(directory, dtype=torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}
