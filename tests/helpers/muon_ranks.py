"""Functions spawned ranks run for the Muon tests: a tiny GPT trained by Megatron's Muon."""

from __future__ import annotations

import torch

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.stages.pretrain.task import PretrainTask
from anyspeed.training import synthetic
from anyspeed.training.config import TrainConfig
from anyspeed.training.muon import MuonConfig
from anyspeed.training.step import Trainer
from helpers.trainer_ranks import load_weights, save_weights

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, vocab_size=128)  # fmt: skip
MOE = dict(MODEL, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)


def _trainer(layout: dict, muon: dict, optimizer: str = "muon", model: dict | None = None):
    cfg = TrainConfig(optimizer=optimizer, muon=MuonConfig(**muon), lr=0.02, clip_grad=0.0,
                      weight_decay=0.1, adam_beta2=0.95, seq_length=32, micro_batch_size=2,
                      global_batch_size=4)  # fmt: skip
    return Trainer(ModelConfig(**(model or MODEL)), Layout(**layout), cfg, PretrainTask())


def one_step_against_torch(muon: dict) -> dict:
    """One Muon step at TP1: each 2-D hidden weight against ``torch.optim.Muon`` and every
    other parameter against ``torch.optim.AdamW``, each from the same weights and gradient."""
    t = _trainer({}, muon)
    chunk = t.model[0]
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    synthetic.train_step(t)
    out = {"muon": 0.0, "adam": 0.0, "moved": 0.0, "muon_names": []}
    for name, p in chunk.named_parameters():
        grad = p.main_grad.detach().clone()
        ref = torch.nn.Parameter(before[name].clone())
        ref.grad = grad
        matrix = p.ndim == 2 and "embedding" not in name and "output_layer" not in name
        if matrix:
            fn = "original" if muon.get("scale_mode") == "shape_scaling" else "match_rms_adamw"
            opt = torch.optim.Muon([ref], lr=0.02, momentum=muon["momentum"], weight_decay=0.1,
                                   nesterov=muon.get("use_nesterov", False),
                                   adjust_lr_fn=fn)  # fmt: skip
            out["muon_names"].append(name)
        else:
            opt = torch.optim.AdamW([ref], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        opt.step()
        key = "muon" if matrix else "adam"
        out[key] = max(out[key], (p.detach() - ref.detach()).abs().max().item())
        out["moved"] = max(out["moved"], (p.detach() - before[name]).abs().max().item())
    return out


def muon_steps(layout: dict, muon: dict, optimizer: str = "muon", steps: int = 4,
               save_init: str | None = None, load: str | None = None,
               model: dict | None = None) -> list[dict]:  # fmt: skip
    """``steps`` steps of the tiny GPT at ``layout`` with Muon (same weights via save/load)."""
    t = _trainer(layout, muon, optimizer, model)
    if save_init:
        save_weights(t, save_init)
    if load:
        load_weights(t, load)
    return [synthetic.train_step(t) for _ in range(steps)]
