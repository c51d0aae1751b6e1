"""Functions spawned ranks run for the precision-feature tests (importable by name)."""

from __future__ import annotations

import torch

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.stages.pretrain.task import PretrainTask
from anyspeed.training import synthetic
from anyspeed.training.config import TrainConfig
from anyspeed.training.step import Trainer


def _masters(opt) -> list:
    """The optimizer's fp32 masters as its state dict gives them (the checkpoint's view)."""
    inner = getattr(opt, "chained_optimizers", [opt])
    out = []
    for o in inner:
        state = o.state_dict()
        groups = state.get("fp32_from_fp16_params")
        if groups is None:  # distributed optimizer: this rank's shards
            groups = o.shard_fp32_from_float16_groups
        out += [p.detach().clone() for g in groups for p in g]
    return out


def _held_bytes(opt) -> dict:
    """Bytes the masters' storages and the residuals hold right now."""
    inner = getattr(opt, "chained_optimizers", [opt])
    masters = residual = 0
    for o in inner:
        store = getattr(o, "reuse_fp32_param", None)
        _, mains = o._get_model_and_main_params_data_float16()
        masters += sum(m.untyped_storage().nbytes() for m in mains)
        if store is not None:
            residual += sum(r.nbytes + t.nbytes for r, t in filter(None, store.residuals))
    return {"masters": masters, "residual": residual}


def reuse_runs(cases: list[dict], steps: int) -> list[dict]:
    """bf16 training per case (``argv``, ``layout``) in one process group: losses, grad norms,
    model weights, the bytes held between steps, and the masters a checkpoint would save."""
    from anyspeed import adaptor
    from anyspeed.features.precision import reuse_fp32

    out = []
    for case in cases:
        adaptor.undo()
        adaptor.apply(argv=case["argv"])
        reuse_fp32.CHUNK_BYTES = case.get("chunk_bytes", 64 * 2**20)
        t = Trainer(
            ModelConfig(), Layout(**case["layout"]), TrainConfig(bf16=True, lr=3e-3), PretrainTask()
        )
        results = [synthetic.train_step(t) for _ in range(steps)]
        held = _held_bytes(t.optimizer)
        out.append(
            {
                "loss": [r["loss"] for r in results],
                "grad_norm": [r["grad_norm"] for r in results],
                "ok": [r["ok"] for r in results],
                "held": held,
                "weights": [p.detach().clone() for p in t.model[0].parameters()],
                "masters": _masters(t.optimizer),
                "params": sum(p.numel() for p in t.model[0].parameters()),
                "dtype": {str(p.dtype) for p in t.model[0].parameters()},
            }
        )
        if case.get("resume"):  # the checkpointed masters load back and training continues
            state = t.optimizer.state_dict()
            t.optimizer.load_state_dict(state)
            out[-1]["after_load"] = [synthetic.train_step(t)["loss"] for _ in range(2)]
    torch.distributed.barrier()
    return out


def attention_dropout_parity() -> dict:
    """SDPAttention with attention dropout on this device, inside Megatron's RNG-tracker fork,
    vs plain math attention with the dropout mask of the seed that fork gives."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from anyspeed.features.ops.attention import SDPAttention
    from anyspeed.features.ops.blocked_attention import full_keep

    heads, groups, d, s, b = 4, 2, 16, 96, 2
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                            num_query_groups=groups, attention_dropout=0.1,
                            masked_softmax_fusion=False)  # fmt: skip
    core = SDPAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                        attention_type="self")  # fmt: skip
    core.train()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (heads, groups, groups))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = {n: t.clone() for n, t in tracker.get_states().items()}
    out = core(q, k, v, None, AttnMaskType.causal)
    advanced = any(not torch.equal(before[n], t) for n, t in tracker.get_states().items())
    tracker.set_states(before)
    with tracker.fork():  # the seed the blocked kernel drew
        seed = int(torch.randint(0, 2**62, ()))
    mult = full_keep(b, heads, s, s, 0.1, seed, causal=True)
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(heads // groups, 1), vh.repeat_interleave(heads // groups, 1)
    scores = (qh @ kh.transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    ref = (torch.softmax(scores, -1) * mult) @ vh
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, heads * d)
    return {"diff": float((out - ref).abs().max()), "seed": seed, "advanced": advanced}


def rank_checks(cases: list[dict], steps: int) -> dict:
    """Everything the precision tests need from one process group."""
    runs = reuse_runs(cases, steps)
    return {"reuse": runs, "attention": attention_dropout_parity()}
