"""Functions spawned ranks run for the inference tests: load a converted checkpoint at a
TP x PP layout and generate (greedy with and without the KV cache, seeded sampling, beams)."""

from __future__ import annotations

import time


def _model(ckpt: str, tp: int, pp: int):
    from anyspeed.commands.session import load_model, model_of
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout

    layout = Layout(tp=tp, pp=pp)
    init_distributed(layout, seed=0)
    model = model_of(ckpt)
    return load_model(ckpt, model, layout)


def generation_cases(ckpt: str, layouts: list[tuple[int, int]], prompts: list[list[int]],
                     new_tokens: int, vocab: int, beam_tokens: int = 12,
                     eos: tuple[int, ...] = ()) -> dict:  # fmt: skip
    """Per layout: greedy tokens with and without the cache (the batch, left-padded), seeded
    samples (twice), beam search with and without the cache, seeded beam sampling (twice);
    with ``eos``, greedy tokens that end at those ids (ended rows leave the batch)."""
    from anyspeed.inference.beam import beam_search
    from anyspeed.inference.decode import Request, generate
    from anyspeed.inference.sampling import SamplingParams

    out = {}
    for tp, pp in layouts:
        model = _model(ckpt, tp, pp)
        res = {}
        for cache in (True, False):
            req = Request(new_tokens, use_kv_cache=cache, vocab_size=vocab)
            t0 = time.perf_counter()
            res[f"greedy_kv{int(cache)}"] = generate(model, prompts, req)
            res[f"seconds_kv{int(cache)}"] = time.perf_counter() - t0
            beam_req = Request(beam_tokens, use_kv_cache=cache, vocab_size=vocab)
            res[f"beam_kv{int(cache)}"] = beam_search(model, prompts[0], beam_req, beams=3)
        if eos:
            res["greedy_eos"] = generate(model, prompts, Request(new_tokens, eos_ids=eos,
                                                                 vocab_size=vocab))  # fmt: skip
        params = SamplingParams(greedy=False, temperature=0.8, top_k=40, top_p=0.9)
        for run in (1, 2):
            req = Request(new_tokens, params=params, seed=7, vocab_size=vocab)
            res[f"sample{run}"] = generate(model, prompts, req)
            req = Request(beam_tokens, params=params, seed=7, vocab_size=vocab)
            res[f"beam_sample{run}"] = beam_search(model, prompts[0], req, beams=3)
        out[f"tp{tp}pp{pp}"] = res
    return out


def choice_picks(ckpt: str, layouts: list[tuple[int, int]], prompts: list[list[int]],
                 candidates: list[int], batch_size: int) -> dict:  # fmt: skip
    """Per layout: the answer each prompt's next-token logits pick among ``candidates``
    (prompts batched, left-padded)."""
    from anyspeed.inference.eval.scoring import (
        continuation_logprobs,
        model_next_logits,
        pick_choices,
    )

    out = {}
    pairs = [(p[:-3], p[-3:]) for p in prompts]  # the last 3 tokens as the continuation
    for tp, pp in layouts:
        model = _model(ckpt, tp, pp)
        out[f"tp{tp}pp{pp}"] = pick_choices(model_next_logits(model), prompts, candidates,
                                            batch_size)  # fmt: skip
        out[f"tp{tp}pp{pp}-likelihood"] = continuation_logprobs(model, pairs, batch_size,
                                                                vocab_size=600)  # fmt: skip
    return out


def all_cases(gen: dict, choices: dict) -> dict:
    """Generation and choice cases in one process group (spawning is the slow part)."""
    return {"gen": generation_cases(**gen), "choices": choice_picks(**choices)}


def family_greedy(ckpts: dict[str, str], new_tokens: int, prompt: list[int]) -> dict:
    """Per converted checkpoint: KV-cache and no-cache greedy tokens at TP1; plus a random MoE
    model (4 experts, top-2, every layer) built from a ModelConfig, with and without cache."""
    from anyspeed.inference.decode import Request, generate
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.config import ModelConfig

    out = {}
    for name, ckpt in ckpts.items():
        model = _model(ckpt, 1, 1)
        out[name] = [generate(model, [prompt], Request(new_tokens, use_kv_cache=c))[0]
                     for c in (True, False)]  # fmt: skip
    moe = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, vocab_size=256, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=48)  # fmt: skip
    chunks = [c.eval() for c in gpt.build_chunks(moe, gpt.transformer_config(moe), Layout())]
    out["moe"] = [generate(chunks, [prompt], Request(new_tokens, use_kv_cache=c))[0]
                  for c in (True, False)]  # fmt: skip
    return out
