"""Functions spawned ranks run for the KV-cache resume tests: three turns of sampling, each
later turn continuing some rows with extra tokens, from the kept cache and afresh."""

from __future__ import annotations

TURN_TOKENS = [[11, 12, 13], [14], [15, 16, 17, 18, 19]]  # a tool turn's tokens, per row
ROWS = [[0, 2], [1, 0], [1]]  # the rows each later turn continues: a subset, reordered, one


def _model(tp: int, pp: int, kind: str):
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.config import ModelConfig

    layout = Layout(tp=tp, pp=pp)
    init_distributed(layout, seed=0)
    extra = {}
    if kind == "moe":
        extra = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    if kind == "learned":
        extra = dict(position_embedding_type="learned_absolute")
    cfg = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, vocab_size=256, max_position_embeddings=256,
                      **extra)  # fmt: skip
    return [c.eval() for c in gpt.build_chunks(cfg, gpt.transformer_config(cfg), layout)]


def turns(layouts: list[tuple[int, int]], prompts: list[list[int]], kinds: list[str],
          greedy: bool, new_tokens: int = 24) -> dict:  # fmt: skip
    """Per layout and model kind: each turn's tokens and log-probs, sampled from the kept
    cache and afresh, and how many turns resumed the cache. Rows end at different steps
    (one token in seven ends a row)."""
    from anyspeed.inference.decode import Kept, Request, sample
    from anyspeed.inference.sampling import SamplingParams

    params = SamplingParams(greedy=greedy, temperature=0.9, top_k=0, top_p=1.0)
    eos = tuple(range(3, 256, 7))
    out = {}
    for tp, pp in layouts:
        for kind in kinds:
            model = _model(tp, pp, kind)
            seeds = tuple(range(100, 100 + len(prompts)))
            req = Request(new_tokens, params, eos_ids=eos, row_seeds=seeds, vocab_size=256)
            kept = Kept()
            got = sample(model, prompts, req, logprobs=True, kept=kept)
            res = {"turn0": got, "kept": [], "fresh": []}
            history = [list(p) + t for p, t in zip(prompts, got[0], strict=True)]
            for turn, rows in enumerate(ROWS, start=1):  # rows of the last turn's batch
                nexts = [history[r] + TURN_TOKENS[(r + turn) % 3] for r in rows]
                more = Request(new_tokens, params, eos_ids=eos, vocab_size=256,
                               row_seeds=tuple(s + turn for s in seeds[: len(rows)]))  # fmt: skip
                kept.rows = rows
                res["kept"].append(sample(model, nexts, more, logprobs=True, kept=kept))
                res["fresh"].append(sample(model, nexts, more, logprobs=True))
                history = [n + t for n, t in zip(nexts, res["kept"][-1][0], strict=True)]
            res["resumed"] = kept.resumed
            cache = kept.stepper.context.key_value_memory_dict.values()  # the last turn's
            res["step_order"] = all(
                t.permute(1, 2, 0, 3).is_contiguous() for kv in cache for t in kv
            )
            out[f"tp{tp}pp{pp}-{kind}"] = res
    return out
