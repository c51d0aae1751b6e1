"""GRPO's rollout model inside spawned ranks: after a training step at TP2 / PP2 / TP2 x PP2,
the weights it gathered, cut again by the checkpoint converter's own sharding
(:func:`anyspeed.distributed.resharding.shard_tp`), equal every rank's training tensors bit for bit
(LoRA's adapters included), and its logits equal the training model's on the same batch."""

from __future__ import annotations

import torch

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.training import synthetic
from anyspeed.training.config import TrainConfig

MODEL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0,
             swiglu=True)  # fmt: skip
CFG = dict(seq_length=16, micro_batch_size=2, global_batch_size=4, lr=1e-2)


def gathered_weights(tp: int, pp: int, lora: bool = False) -> dict:
    """(tensors compared, tensors differing from the training shards, max logit diff)."""
    from megatron.core import parallel_state as ps

    from anyspeed.distributed.resharding import (
        ADAPTER,
        global_layer_numbers,
        global_name,
        materialize,
        shard_tp,
        state_tensors,
        tp_parts,
    )
    from anyspeed.inference.forward import pipeline_forward
    from anyspeed.stages.common.rl.rollout_model import RolloutModel
    from anyspeed.training.model_pipeline import unwrap
    from anyspeed.training.step import Trainer
    from helpers.task_ranks import ProbeTask

    model, cfg = ModelConfig(**MODEL), TrainConfig(**CFG)
    t = Trainer(model, Layout(tp=tp, pp=pp), cfg, ProbeTask(lora=lora))
    mbs = synthetic.microbatches(model.vocab_size, cfg, 0)
    t.step(mbs)  # weights away from their initial values
    roll = RolloutModel(t)
    seconds = roll.sync(t)
    rank = ps.get_tensor_model_parallel_rank()
    compared, differ = 0, []
    for chunk in t.model:
        numbers = global_layer_numbers(unwrap(chunk))
        for name, local in state_tensors(unwrap(chunk)).items():
            glob = global_name(name, numbers)
            if glob not in roll.targets:
                continue
            full = roll.targets[glob]
            rule = ADAPTER.sub(".weight", glob)  # an adapter is split as its layer
            mine = full if full.shape == local.shape else materialize(
                shard_tp(rule, full, tp, rank, tp_parts(rule, model)))  # fmt: skip
            compared += 1
            if not torch.equal(mine, local):
                differ.append(glob)
    batch = mbs[0]
    want = pipeline_forward(t.model, batch["tokens"], batch["position_ids"])
    with roll.state.entered(), torch.no_grad():
        got = unwrap(roll.chunks[0])(batch["tokens"], batch["position_ids"], None)
    diff = None if want is None else float((got.float() - want.float()).abs().max())
    adapters = sum(".lora_" in n for n in roll.targets)
    return {"compared": compared, "differ": differ, "logit_diff": diff, "seconds": seconds,
            "rollout_tensors": len(roll.targets), "adapters": adapters}  # fmt: skip
