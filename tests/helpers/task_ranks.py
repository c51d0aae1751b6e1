"""The wider task interface inside spawned ranks: the shared log-prob forward, frozen models
(a checkpoint copy and LoRA's adapters-off base), named metrics and generation between steps,
each against plain PyTorch math on the gathered logits of the same weights."""

from __future__ import annotations

import torch

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.stages.pretrain.task import PretrainTask
from anyspeed.training import synthetic
from anyspeed.training.config import TrainConfig
from anyspeed.training.task import FrozenModel

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
CFG = dict(seq_length=16, micro_batch_size=2, global_batch_size=4, lr=1e-2)
REAL_VOCAB = 200  # the "tokenizer's" vocabulary inside the padded 256 rows


def reference_logprobs(chunks, batch, vocab: int | None = None) -> torch.Tensor | None:
    """log_softmax of the gathered logits, gathered at the labels (plain PyTorch)."""
    from anyspeed.inference.forward import pipeline_forward

    logits = pipeline_forward(chunks, batch["tokens"], batch["position_ids"])
    if logits is None:
        return None
    logits = logits.float()[..., : vocab or logits.shape[-1]]
    return logits.log_softmax(-1).gather(-1, batch["labels"][..., None].to(logits.device))[..., 0]


class ProbeTask(PretrainTask):
    """Pretraining plus two named metrics: the token NLL as a [sum, count] pair, and a
    scalar (the micro-batch's mean label id / 1000, data-only, so its reference is exact)."""

    metrics = ("nll", "label mean")

    def __init__(self, frozen: dict | None = None, lora: bool = False) -> None:
        self.frozen, self.lora = frozen or {}, lora

    def transforms(self):
        if not self.lora:
            return []
        from anyspeed.training.lora import apply_lora

        def add(chunk, model):
            return apply_lora(chunk, ["linear_qkv", "linear_fc2"], 4, 8.0)

        return [add]

    def frozen_models(self):
        return self.frozen

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        scalar = batch["labels"].double().mean() / 1000

        def loss_func(losses):
            from anyspeed.stages.pretrain.task import lm_loss

            loss = lm_loss(losses, None)
            pair = torch.stack([losses.detach().double().sum(), torch.tensor(losses.numel())])
            return loss, {self.loss_key: loss.detach().clone(), "nll": pair,
                          "label mean": scalar}  # fmt: skip

        return output, loss_func


def _max_diff(a, b) -> float:
    return float((a.cpu() - b.cpu()).abs().max())


def interface(tp: int, pp: int, ckpt_dir: str) -> dict:
    """One layout: log-probs vs the reference (full and real vocab), a frozen checkpoint copy
    after training steps, LoRA's base, the named metrics, and generation between steps."""
    from anyspeed.training.frozen import build_frozen
    from anyspeed.training.step import Trainer

    layout, model, cfg = Layout(tp=tp, pp=pp), ModelConfig(**MODEL), TrainConfig(**CFG)
    out: dict = {}
    t = Trainer(model, layout, cfg, ProbeTask())
    mbs = synthetic.microbatches(model.vocab_size, cfg, 0)
    before = [reference_logprobs(t.model, b) for b in mbs]
    got = t.logprobs(mbs)
    in_vocab = [dict(b, labels=b["labels"] % REAL_VOCAB) for b in mbs]  # real token ids only
    got_real = t.logprobs(in_vocab, vocab_size=REAL_VOCAB)
    real = [reference_logprobs(t.model, b, REAL_VOCAB) for b in in_vocab]  # every rank
    last = got is not None
    if last:
        out["logprob_diff"] = max(_max_diff(g, r) for g, r in zip(got, before, strict=True))
        out["real_vocab_diff"] = max(_max_diff(g, r) for g, r in zip(got_real, real, strict=True))
    from anyspeed.checkpoint.save import save_checkpoint

    save_checkpoint(ckpt_dir, 1, t.model, None, None, {}, save_rng=False)
    t.frozen = build_frozen(t, {"reference": FrozenModel(load=ckpt_dir)})  # the real load path
    res = t.step(mbs)
    out["metrics"] = res["metrics"]
    out["loss"] = res["loss"]
    out["label_mean_ref"] = float(torch.cat([b["labels"] for b in mbs]).double().mean() / 1000)
    ref = t.logprobs(mbs, model="reference")
    now = t.logprobs(mbs)
    if last:
        out["frozen_diff"] = max(_max_diff(r, b) for r, b in zip(ref, before, strict=True))
        out["trained_moved"] = max(_max_diff(n, b) for n, b in zip(now, before, strict=True))
    out["lora"] = _lora_base(model, layout, cfg)
    out["generate"] = _generate_between_steps(t, model)
    return out


def _lora_base(model: ModelConfig, layout: Layout, cfg: TrainConfig) -> dict:
    """Under LoRA the adapters-off view is the untouched base: after steps that moved the
    adapters, its log-probs equal the model's before training."""
    from anyspeed.training.frozen import build_frozen
    from anyspeed.training.step import Trainer

    t = Trainer(model, layout, cfg, ProbeTask(lora=True))
    mbs = synthetic.microbatches(model.vocab_size, cfg, 0)
    before = t.logprobs(mbs)
    t.frozen = build_frozen(t, {"reference": FrozenModel(adapters_off=True)})
    t.step(mbs)  # lora_B starts at zero: one step moves the adapters
    base, now = t.logprobs(mbs, model="reference"), t.logprobs(mbs)
    if before is None:
        return {}
    base_diff = max(_max_diff(a, b) for a, b in zip(base, before, strict=True))
    moved = max(_max_diff(a, b) for a, b in zip(now, before, strict=True))
    return {"base_diff": base_diff, "trained_moved": moved}


def _generate_between_steps(t, model: ModelConfig) -> dict:
    """A data source that samples from the policy before each step (as GRPO's does): the
    tokens equal a greedy decode by full forwards of the same weights, the model trains again
    afterwards, and each step sees the weights the previous step left."""
    from anyspeed.inference.decode import Request, share
    from anyspeed.inference.forward import pipeline_forward

    prompts = [[5, 9, 11, 3], [7, 1, 2, 8]]
    req = Request(max_new_tokens=4, use_kv_cache=True)
    agree, modes = [], []
    for _ in range(2):  # the second round samples from the weights the step left
        new = t.generate(prompts, req)
        modes.append(all(m.training for m in t.model))
        seqs = [list(p) for p in prompts]
        for _ in range(req.max_new_tokens):  # the reference: no cache, argmax of full logits
            logits = pipeline_forward(t.model, torch.tensor(seqs))
            nxt = torch.zeros(len(seqs), dtype=torch.int64)
            if logits is not None:
                nxt = logits[:, -1].float().argmax(-1).cpu()
            nxt = share(nxt)
            for s, n in zip(seqs, nxt.tolist(), strict=True):
                s.append(n)
        agree.append(new == [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)])
        cfg = t.cfg
        rows = [s[: cfg.seq_length + 1] + [0] * (cfg.seq_length + 1 - len(s)) for s in seqs] * 2
        full = torch.tensor(rows)
        t.step(_as_microbatches(full, cfg))
    return {"agree": agree, "train_mode_after": modes}


def _as_microbatches(full: torch.Tensor, cfg: TrainConfig) -> list[dict]:
    """This rank's micro-batches of a [global batch, seq+1] token tensor."""
    from megatron.core import parallel_state as ps

    from anyspeed.device import torch_device

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = cfg.global_batch_size // dp
    mine = full[rank * per : (rank + 1) * per]
    dev = torch_device()
    return [{"tokens": mine[i : i + cfg.micro_batch_size, :-1].contiguous().to(dev),
             "labels": mine[i : i + cfg.micro_batch_size, 1:].contiguous().to(dev),
             "position_ids": torch.arange(cfg.seq_length, device=dev).expand(
                 min(cfg.micro_batch_size, per - i), -1)}
            for i in range(0, per, cfg.micro_batch_size)]  # fmt: skip


def layouts(ckpt_dir: str, cases: list[tuple[int, int]]) -> dict:
    """:func:`interface` for each (TP, PP) in one process group."""
    return {case: interface(*case, f"{ckpt_dir}/{case[0]}x{case[1]}") for case in cases}


def exact_pass_peaks(micro: int) -> dict:
    """Peak tensor bytes of the exact (autograd on) log-prob pass over 1 and ``micro``
    micro-batches of one process, and whether both passes give the same values."""
    from anyspeed.features.memory.trace import AllocationTrace
    from anyspeed.training.step import Trainer

    model = ModelConfig(**dict(MODEL, hidden_size=128, ffn_hidden_size=512))
    cfg = TrainConfig(**dict(CFG, seq_length=64, global_batch_size=2 * micro))
    t = Trainer(model, Layout(), cfg, ProbeTask())
    mbs = synthetic.microbatches(model.vocab_size, cfg, 0)
    peaks, values = [], []
    for batches in (mbs[:1], mbs):
        with AllocationTrace() as trace:
            values.append(t.logprobs(batches, exact=True))
        peaks.append(trace.peak())
    return {"peaks": peaks, "same": torch.equal(values[0][0], values[1][0])}
