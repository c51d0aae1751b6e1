"""Ranks of the lean decode-step test: random models of several layer kinds, decoded step by
step through Megatron's static cache twice, once with each step through ``decode_step`` and
once through Megatron's own forward; the logits of every step are returned side by side."""

from __future__ import annotations

import torch

# Gemma's layer: tanh GeGLU, sandwich and zero-centred norms, a 3-key window on the first layer
_GEMMA = dict(num_query_groups=2, kv_channels=32, swiglu=False, gelu_tanh=True, post_norm=True,
              layernorm_zero_centered_gamma=True, window_size=3, window_attn_skip_freq="2",
              query_pre_attn_scalar=24.0)  # fmt: skip
CASES = {
    "gqa-swiglu": dict(num_query_groups=2),
    "bf16": dict(num_query_groups=2),  # weights and activations in bf16
    "qkv-bias-tied": dict(num_query_groups=2, add_qkv_bias=True, tie_embeddings=True),
    "qk-norm": dict(qk_layernorm=True, kv_channels=24),
    "layernorm-gelu-bias": dict(
        normalization="LayerNorm", swiglu=False, add_bias_linear=True, rotary_percent=0.5
    ),  # fmt: skip
    "moe": dict(
        num_query_groups=2, num_experts=4, moe_ffn_hidden_size=48, moe_layer_freq="[0]+[1]"
    ),  # fmt: skip
    "learned-positions": dict(position_embedding_type="learned_absolute"),
    # a window of 3 keys on the first layer (Phi-3's 4k models, Mistral)
    "window": dict(num_query_groups=2, window_size=3, window_attn_skip_freq="2"),
    # Gemma 2's hooks (sandwich norms, capped scores and logits, scaled embeddings), replayed
    "gemma2": dict(
        _GEMMA,
        input_embeds_norm=True,
        attn_logit_softcapping=2.0,
        output_logit_softcapping=3.0,
        tie_embeddings=True,
    ),  # fmt: skip
    # Gemma 3's: QK norm, its windowed layer's own RoPE (a layer pre-hook), linear-scaled RoPE
    "gemma3": dict(
        _GEMMA, qk_layernorm=True, rotary_base_local=100.0, rotary_seq_len_interpolation_factor=4.0
    ),  # fmt: skip
    # GPT-OSS's attention: learnable sinks, YaRN on plain attention (its mscale), QKV bias, a
    # window; its MoE experts (with the clamped, offset GLU) are called as their module
    "gpt-oss": dict(
        num_query_groups=2,
        softmax_type="learnable",
        window_size=3,
        window_attn_skip_freq="2",
        add_qkv_bias=True,
        position_embedding_type="yarn",
        rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=4,
        num_experts=4,
        moe_ffn_hidden_size=48,
        quick_geglu=True,
        swiglu=False,
        glu_linear_offset=1.0,
        activation_func_clamp_value=7.0,
    ),  # fmt: skip
    # Phi-3.5's LongRoPE past its pretraining length (8 slots): the long set and its factor
    "longrope": dict(
        num_query_groups=2,
        rotary_percent=0.75,
        max_position_embeddings=64,
        longrope_short_factor=(1.0, 1.1, 1.2, 1.5, 2.0, 3.0),
        longrope_long_factor=(1.5, 2.0, 4.0, 8.0, 16.0, 32.0),
        longrope_original_max_position_embeddings=8,
    ),  # fmt: skip
    "mla": dict(
        multi_latent_attention=True,
        qk_layernorm=True,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
    ),  # fmt: skip
}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [30, 12]]  # padded batch: the decode mask matters
# per ``_steps`` call: whether every cached key / value of a plain-attention layer is laid out
# [batch, groups, seq, dim] in memory (the order ``decode_step.allocate_cache`` gives)
STEP_ORDER: list[bool] = []


def _steps(model: list, lean: bool, steps: int,
           forced: list[torch.Tensor] | None = None) -> tuple[list, list]:  # fmt: skip
    """Next-token logits of each step (None off the last pipeline stage) and the tokens fed
    (greedy, or ``forced``), every decode step lean or Megatron's."""
    from anyspeed.features.inference import decode_step
    from anyspeed.inference.decode import Batch, Stepper, share

    chunk = model[0]
    if not lean:
        chunk.__dict__[decode_step._PLAN] = False  # "not supported": Megatron's forward
    stepper = Stepper(model, Batch.left_padded(PROMPTS, 0), len(PROMPTS[0]) + steps, True)
    out, fed = [], []
    for i in range(steps):
        logits = stepper.logits()
        out.append(logits)
        chosen = torch.zeros(len(PROMPTS), dtype=torch.int64)
        if logits is not None:
            chosen = logits.argmax(-1)
        fed.append(share(chosen) if forced is None else forced[i])
        stepper.append(fed[-1])
    chunk.__dict__.pop(decode_step._PLAN, None)
    STEP_ORDER.append(
        all(t.permute(1, 2, 0, 3).is_contiguous()
            for kv in stepper.context.key_value_memory_dict.values() for t in kv)
    )  # fmt: skip
    return out, fed


def lean_vs_megatron(layouts: list[tuple[int, int]], steps: int) -> dict:
    """Per layout "tpXppY" and case: (lean logits, Megatron logits, decode steps that ran
    lean on this rank); plus the stop-string, likelihood and beam checks at the first."""
    from anyspeed.features.inference import decode_step

    calls = []
    attention = decode_step._attention

    def counted(*args, **kwargs):
        calls.append(1)
        return attention(*args, **kwargs)

    decode_step._attention = counted
    out = {}
    for tp, pp in layouts:
        for name, model in _models(tp, pp):
            with torch.inference_mode():
                calls.clear()
                lean, fed = _steps(model, True, steps)
                n = len(calls)  # Megatron's run is fed the same tokens (bf16 near-ties)
                megatron = _steps(model, False, steps, fed)[0]
                order = STEP_ORDER[-2:]  # (lean run, Megatron's run)
                out[f"tp{tp}pp{pp}", name] = (lean, megatron, n, order)
                out["compact", f"tp{tp}pp{pp}", name] = _compacted(model)
            if name == "gqa-swiglu" and (tp, pp) == layouts[0]:
                out["stop"] = _stopped(model)
                out["likelihood"] = _likelihoods(model)
                out["beams"] = _beams(model)
    return out


def _models(tp: int, pp: int, only: str | None = None):
    """Each case's random model at TP x PP (the same seed for every case; ``only``: one)."""
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.config import ModelConfig

    layout = Layout(tp=tp, pp=pp)
    init_distributed(layout, seed=0)
    for name, fields in CASES.items():
        if only not in (None, name):
            continue
        cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                          vocab_size=256, **fields)  # fmt: skip
        torch.manual_seed(0)
        config = gpt.transformer_config(cfg, layout, bf16=name == "bf16")
        yield name, [c.eval() for c in gpt.build_chunks(cfg, config, layout)]


def _compacted(model: list) -> dict:
    """Per mode (greedy; sampled with a generator per row): a batch whose rows end at
    different steps (EOS ids taken from the rows' free greedy runs), decoded with its ended
    rows leaving the batch; each row decoded alone; the batches the decode loop cut down to."""
    from dataclasses import replace

    from anyspeed.inference.decode import Request, Stepper, sample
    from anyspeed.inference.sampling import SamplingParams

    prompts = [*PROMPTS, [1, 2, 3], [200, 7, 7, 9, 4]]
    cut: list[int] = []
    keep_rows = Stepper.keep_rows

    def counted(self, rows):
        kept = keep_rows(self, rows)
        cut.extend([len(rows)] if kept else [])
        return kept

    Stepper.keep_rows = counted
    out = {}
    modes = {"greedy": (SamplingParams(), None),
             "sampled": (SamplingParams(greedy=False), (11, 12, 13, 14))}  # fmt: skip
    try:
        for mode, (params, seeds) in modes.items():
            free = sample(model, prompts, Request(12, params, row_seeds=seeds))[0]
            eos = (free[0][2], free[1][5], free[2][8])  # ids the rows reach at steps 3, 6, 9
            req = Request(12, params, eos_ids=eos, row_seeds=seeds)
            cut.clear()
            batch = sample(model, prompts, req, logprobs=True)
            sizes = list(cut)
            alone = []
            for i, p in enumerate(prompts):
                one = replace(req, row_seeds=seeds[i : i + 1] if seeds else None)
                toks, lps = sample(model, [p], one, logprobs=True)
                alone.append((toks[0], lps[0]))
            out[mode] = (batch, alone, sizes)
    finally:
        Stepper.keep_rows = keep_rows
    return out


def detokenize(ids: list[int]) -> str:
    """A stand-in detokenizer: the ids as text."""
    return " ".join(map(str, ids)) + " "


def _stopped(model: list) -> tuple[list[list[int]], str, list[list[int]]]:
    """Greedy tokens of PROMPTS without a stop string, the stop string (row 0's tokens 3-5 as
    text), and the tokens with it."""
    from anyspeed.inference.decode import Request, generate

    free = generate(model, PROMPTS, Request(12))
    stop = detokenize(free[0][3:6])
    req = Request(12, stop=(stop,), detokenize=detokenize)
    return free, stop, generate(model, PROMPTS, req)


def _likelihoods(model: list) -> tuple[list, list]:
    """Continuation log-probabilities scored batched (left-padded, batch 3) and one pair at a
    time from plain log-softmax of an unpadded forward."""
    from anyspeed.inference.eval.scoring import continuation_logprobs
    from anyspeed.inference.forward import pipeline_forward

    pairs = [([5, 17, 99, 3], [150, 41]), ([30, 12], [7]), ([8, 9, 10, 11, 12], [13, 14, 15]),
             ([1], [2, 3])]  # fmt: skip
    got = continuation_logprobs(model, pairs, batch_size=3, vocab_size=200)
    ref = []
    for ctx, cont in pairs:
        logits = pipeline_forward(model, torch.tensor([ctx + cont]))[0, :, :200].double()
        logp = logits.log_softmax(-1)
        ref.append(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
    return got, ref


def _beams(model: list) -> list[list[int]]:
    """Beam search, then beam search with sampling at seeds 7, 7 and 8 (temperature 1)."""
    from anyspeed.inference.beam import beam_search
    from anyspeed.inference.decode import Request
    from anyspeed.inference.sampling import SamplingParams

    out = [beam_search(model, PROMPTS[0], Request(10), beams=3)]
    params = SamplingParams(greedy=False)
    for seed in (7, 7, 8):
        out.append(beam_search(model, PROMPTS[0], Request(10, params=params, seed=seed), beams=3))
    return out


def transposed_vs_plain(tp: int, steps: int) -> dict:
    """Per case: (weights :func:`transpose_for_decode` moved, the logits of each decode step
    with them moved, the logits with Megatron's weight order), both through the lean step."""
    from anyspeed.features.inference.weights import transpose_for_decode

    out = {}
    for name, model in _models(tp, 1):
        if name not in ("gqa-swiglu", "qkv-bias-tied", "bf16", "moe", "mla"):
            continue
        with torch.inference_mode():
            plain, fed = _steps(model, True, steps)
            moved = transpose_for_decode(model)
            moved_logits = _steps(model, True, steps, fed)[0]
        out[name] = (moved, moved_logits, plain)
    return out


def packed_vs_plain(tp: int, steps: int) -> dict:
    """Per case: (what ``prepare_for_decode`` did, the logits of each step through it, the
    lean step's logits without it, the same two after one weight changed in place and another
    got new data, whether it had packed weights; and a rollout's: packed during it, its logits,
    freed after)."""
    from anyspeed.features.inference import packed
    from anyspeed.features.inference.weights import packed_during, prepare_for_decode

    out = {}
    for name, model in _models(tp, 1):
        if name not in ("gqa-swiglu", "qkv-bias-tied", "layernorm-gelu-bias", "bf16", "moe"):
            continue
        with torch.no_grad(), packed_during(model):  # a rollout of a model being trained
            inside = (packed.of(model[0]) is not None, _steps(model, True, steps)[0])
        rollout = (*inside, packed.of(model[0]) is None)  # (packed in it, its logits, freed)
        with torch.inference_mode():
            plain, fed = _steps(model, True, steps)
            kind = prepare_for_decode(model)
            got = _steps(model, True, steps, fed)[0]
            layers = model[0].decoder.layers
            layers[0].mlp.linear_fc2.weight.mul_(3.0)  # an in-place update
            qkv = layers[-1].self_attention.linear_qkv.weight
            qkv.data = qkv.data * 0.5  # new data
            changed = _steps(model, True, steps, fed)[0]
            packs = packed.of(model[0])
            packed.disable(model)
            changed_plain = _steps(model, True, steps, fed)[0]
        out[name] = (kind, got, plain, changed, changed_plain, packs is not None, rollout)
    return out


def plans_with_hooks() -> dict:
    """Whether the decode step takes a plain model, the same with soft-capped logits (a hook
    on the output layer it replays), with scaled embeddings (a hook it calls), and with a hook
    it does not know on the output layer or on a layer's QKV projection (a LoRA adapter's)."""
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.features.inference.decode_step import plan_of
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.config import ModelConfig

    init_distributed(Layout(), seed=0)
    out = {}
    for name, extra in {"plain": {}, "capped-logits": {"output_logit_softcapping": 30.0},
                        "scaled-embeddings": {"input_embeds_norm": True}}.items():  # fmt: skip
        cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                          vocab_size=256, **extra)  # fmt: skip
        model = gpt.build(cfg, gpt.transformer_config(cfg)).eval()
        out[name] = plan_of(model) is not None
    qkv = "decoder.layers.1.self_attention.linear_qkv"
    for name, where in (("user-hook-on-head", "output_layer"), ("user-hook-on-qkv", qkv)):
        cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                          vocab_size=256)  # fmt: skip
        model = gpt.build(cfg, gpt.transformer_config(cfg)).eval()
        model.get_submodule(where).register_forward_hook(lambda m, a, o: o)
        out[name] = plan_of(model) is not None
    return out


def windowed_rows_through_megatron() -> dict:
    """Greedy tokens of the "window" case's left-padded batch through Megatron's forward (the
    lean step off) and of each prompt alone: per row, whether they agree."""
    from anyspeed.features.inference import decode_step
    from anyspeed.inference.decode import Request, sample
    from anyspeed.inference.sampling import SamplingParams

    ((_, model),) = _models(1, 1, only="window")
    model[0].__dict__[decode_step._PLAN] = False  # "not supported": Megatron's forward
    with torch.inference_mode():
        batch = sample(model, PROMPTS, Request(8, SamplingParams()))[0]
        alone = [sample(model, [p], Request(8, SamplingParams()))[0][0] for p in PROMPTS]
    return {"same": [b == a for b, a in zip(batch, alone, strict=True)]}
