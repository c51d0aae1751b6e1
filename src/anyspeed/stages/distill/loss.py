"""Distillation's loss over a teacher's top-k tokens, pure tensor math (no Megatron)."""

from __future__ import annotations

import torch


def topk_forward_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens per position [..., k] -> [...]:
    sum_k p_t(k) (log p_t(k) - log p_s(k)), both log-probabilities normalised over the whole
    vocabulary (the teacher's mass outside its top-k is left out, not renormalised). Its
    gradient pulls the student's log-probability of each token by the teacher's probability."""
    return (teacher.exp() * (teacher - student)).sum(-1)
