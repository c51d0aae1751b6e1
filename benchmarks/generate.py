"""Decode speed: anyspeed's KV-cache generation vs no cache vs transformers' ``generate``.

One random Llama-style model (default 4 layers, hidden 512, 8 heads / 4 KV groups, vocab 4096)
is saved as a Hugging Face directory and converted to Megatron once. With the same threads for
every row it greedily decodes ``--new-tokens`` (256) after a ``--prompt-tokens``
prompt: with Megatron's static KV cache, without it (every step re-runs the whole sequence),
and with transformers' ``generate(do_sample=False)`` (its default dynamic cache, SDPA
attention, under ``torch.inference_mode`` like anyspeed's loop). Rows are interleaved round by
round and each keeps its best of ``--repeats`` rounds (this VM's speed drifts by tens of percent
within minutes). Two more rows decode with anyspeed's KV cache without packed weights and with
the cache in its other memory order (Megatron's on a CPU, the lean step's elsewhere). Tokens are
checked equal; the table gives new tokens per second and ratios. transformers runs in a process
of its own, driven round by round with the others: as in a transformers user's process,
nothing of anyspeed's (its adaptor's patches, its models' memory) is in it.

    python benchmarks/generate.py [--new-tokens 256] [--hidden 512] [--layers 4] [--batch 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from typing import Any, NamedTuple

import torch
from transformers.utils import logging as hf_logging

from anyspeed import quiet

# before Megatron imports, here and in each spawned rank (which imports this module first)
quiet.install()
hf_logging.disable_progress_bar()  # transformers' bars for a 40-tensor save and load

from anyspeed.testing import run_distributed  # noqa: E402

SHAPES = {
    # a random Llama-style model: 8 heads / 4 KV groups, SwiGLU at 8/3 of hidden (``--hidden``)
    "default": {},
    # SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M's config.json): 30 layers, hidden 576,
    # 9 heads / 3 KV groups, FFN 1536, vocab 49152, tied embeddings, 134.5M parameters
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    rms_norm_eps=1e-5),
    # Gemma 2's layer at the default size (sandwich norms, soft-capped scores and logits, a
    # 64-key window on every other layer, tanh GeGLU, scaled and tied embeddings)
    "gemma2": dict(query_pre_attn_scalar=64, sliding_window=64),
    # GPT-OSS's layer at the default size (learnable sinks, YaRN, a 64-key window on every
    # other layer, QKV and output biases, 4 experts top-2 with the clamped GLU)
    "gpt-oss": dict(sliding_window=64, num_local_experts=4, num_experts_per_tok=2),
}  # fmt: skip
# the preset whose HF config a shape starts from
BASES = {"gemma2": "tiny-gemma2", "gpt-oss": "tiny-gpt-oss"}


def _hf_model(directory: str, a: argparse.Namespace) -> int:
    """Save the random model as an HF directory; its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from anyspeed.models import get_preset
    from anyspeed.models.hf import hf_config

    cfg = dict(hf_config(get_preset(BASES.get(a.shape, "tiny-llama3"))), hidden_size=a.hidden,
               intermediate_size=a.hidden * 8 // 3 // 64 * 64, num_hidden_layers=a.layers,
               num_attention_heads=8, num_key_value_heads=4, head_dim=a.hidden // 8,
               vocab_size=a.vocab, max_position_embeddings=16384)  # fmt: skip
    cfg.update(SHAPES[a.shape])
    cfg.pop("layer_types", None)  # (the base's layer count; transformers alternates again)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def _bandwidth_rows(nbytes: int) -> dict:
    """Rows that stream a buffer of ``nbytes`` (the weights' size): ``read`` sums it, ``copy``
    copies it (bytes of the buffer per second: the copy's write is not counted). Each row
    makes three passes back to back and returns its fastest pass's seconds: memory left idle
    between rounds reads up to 3x slower on this VM at first, while the decode's weights
    stay hot. Timed with the decode rows, they give this thread's bandwidth in the same
    minutes."""
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)

    def passes(fn) -> float:  # noqa: ANN001 - a no-argument callable
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    return {
        "read": lambda: passes(lambda: src.sum().item()),
        "copy": lambda: passes(lambda: dst.copy_(src)),
    }


def _timed(fns: dict, repeats: int, slow: str = "nokv") -> dict:
    """Best time and output of each function, the functions interleaved round by round (a
    burst of load on a shared machine then hits every row alike); the ``slow`` row (no KV
    cache, ~10x the others) runs only in the first two rounds."""
    best = {k: (float("inf"), None) for k in fns}
    for round_ in range(repeats):
        for k, fn in fns.items():
            if k == slow and round_ >= 2:
                continue
            t0 = time.perf_counter()
            out = fn()
            took = time.perf_counter() - t0
            if isinstance(out, _Took):  # timed where it ran
                took, out = out
            best[k] = (min(best[k][0], took), out)
    return best


class _Took(NamedTuple):
    seconds: float
    out: Any


class _HfProcess:
    """transformers' rows in a process of their own, driven round by round from the rank's
    and timed there: a transformers user's process has none of anyspeed's adaptor patches or
    models in it."""

    def __init__(self, hf: str, prompts: list[list[int]], new: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, hf, prompts, new, threads)
        self.proc = ctx.Process(target=_hf_serve, args=args, daemon=True)
        self.proc.start()
        child.close()

    def row(self, key: str):  # noqa: ANN201 - a no-argument callable
        def run() -> _Took:
            self.conn.send(key)
            return _Took(*self.conn.recv())

        return run

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(60)


def _hf_serve(conn: Any, hf: str, prompts: list[list[int]], new: int, threads: int) -> None:
    """The transformers process: runs the row it is sent, answers (seconds, tokens)."""
    torch.set_num_threads(threads)
    fns = {
        key: _hf_generate(hf, prompts, new, copied)
        for key, copied in (("hf", False), ("hf_copied", True))
    }
    while (key := conn.recv()) is not None:
        t0 = time.perf_counter()
        out = fns[key]()
        conn.send((time.perf_counter() - t0, out))


def _hf_generate(hf: str, prompts: list[list[int]], new: int, copied: bool):
    """transformers' greedy ``generate`` on the model in ``hf``, on anyspeed's device. On the
    CPU its weights are views of the memory-mapped safetensors file (the page cache);
    ``copied`` gives it private copies, held like anyspeed's (ordinary process memory)."""
    from transformers import AutoModelForCausalLM

    from anyspeed.device import torch_device

    dev = torch_device()
    with open(f"{hf}/config.json") as f:  # soft-capped scores, sinks: its eager attention
        cfg = json.load(f)
    eager = cfg.get("attn_logit_softcapping") or cfg.get("model_type") == "gpt_oss"
    attn = "eager" if eager else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                 attn_implementation=attn).eval()  # fmt: skip
    model.to(dev)
    model.generation_config.eos_token_id = None
    if copied and dev.type == "cpu":
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()

    def run() -> list[list[int]]:
        with torch.inference_mode():  # the mode anyspeed's generate runs in
            ids = model.generate(torch.tensor(prompts, device=dev), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=0)  # fmt: skip
        return ids[:, len(prompts[0]) :].tolist()  # .tolist() waits for the device

    return run


def _other_cache_order(fn):  # noqa: ANN001, ANN202 - a no-argument callable
    """``fn`` with the lean step's KV cache in the other memory order on this device (Megatron's
    on a CPU, the step's elsewhere): the same tokens, the order's own speed."""
    from anyspeed.device import torch_device
    from anyspeed.features.inference import decode_step

    def run():  # noqa: ANN202
        saved = decode_step.STEP_ORDER_DEVICES
        decode_step.STEP_ORDER_DEVICES = saved ^ {torch_device().type}
        try:
            return fn()
        finally:
            decode_step.STEP_ORDER_DEVICES = saved

    return run


def _run(hf: str, mg: str, prompts: list[list[int]], new: int, repeats: int, threads: int,
         nocache: bool, weight_bytes: int) -> dict:  # fmt: skip
    from anyspeed.commands.session import load_model, model_of
    from anyspeed.device import torch_device
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.features.inference import decode_step, packed
    from anyspeed.features.inference.weights import transpose_for_decode
    from anyspeed.inference.decode import Request, generate
    from anyspeed.layout import Layout

    torch.set_num_threads(threads)
    init_distributed(Layout(), seed=0)
    model = load_model(mg, model_of(mg), Layout())
    fns = {}
    for name, cache in (("kv", True), ("nokv", False))[: 2 if nocache else 1]:
        req = Request(new, use_kv_cache=cache)
        fns[name] = lambda req=req: generate(model, prompts, req)
    # the same model without packed weights (the fallback: weights in transposed order)
    plain = load_model(mg, model_of(mg), Layout())
    packed.disable(plain)
    transpose_for_decode(plain)
    fns["kv_plain"] = lambda: generate(plain, prompts, Request(new, use_kv_cache=True))
    fns["kv_order"] = _other_cache_order(lambda: generate(model, prompts, Request(new)))
    hf_rows = _HfProcess(hf, prompts, new, threads)
    for key in ("hf", "hf_copied"):
        fns[key] = hf_rows.row(key)
    if len(prompts) == 1:  # one row: each step streams every weight once
        fns["prefill"] = lambda: generate(model, prompts, Request(1, use_kv_cache=True))
        fns.update(_bandwidth_rows(weight_bytes))
    try:
        out = _timed(fns, repeats)
    finally:
        hf_rows.close()
    out["threads"] = torch.get_num_threads()
    out["step_order"] = torch_device().type in decode_step.STEP_ORDER_DEVICES
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7,
                   help="rounds; each row's best is kept (the no-cache row: 2)")  # fmt: skip
    p.add_argument("--batch", type=int, default=1,
                   help="prompts decoded together (same length: no padding)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every row (1: steady on a shared machine)")  # fmt: skip
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="default",
        help="smollm2: SmolLM2-135M's shape (overrides --hidden/--layers/--vocab); gemma2, "
        "gpt-oss: their layer at --hidden/--layers",
    )
    p.add_argument(
        "--no-nocache",
        dest="nocache",
        action="store_false",
        help="skip the no-KV-cache row (slow on deep models)",
    )
    a = p.parse_args()
    from anyspeed.convert import hf_to_megatron

    with tempfile.TemporaryDirectory(prefix="anyspeed-bench-gen-") as root:
        params = _hf_model(f"{root}/hf", a)
        hf_to_megatron(f"{root}/hf", f"{root}/mg")
        with open(f"{root}/hf/config.json") as f:
            vocab = json.load(f)["vocab_size"]
        prompts = torch.randint(
            0, vocab, (a.batch, a.prompt_tokens), generator=torch.Generator().manual_seed(1)
        )
        res = run_distributed(_run, 1, hf=f"{root}/hf", mg=f"{root}/mg", prompts=prompts.tolist(),
                              new=a.new_tokens, repeats=a.repeats, threads=a.threads,
                              nocache=a.nocache, weight_bytes=params * 4,
                              timeout=3600)[0]  # fmt: skip
    _report(a, res, params)


def _report(a: argparse.Namespace, res: dict, params: int) -> None:
    """The table: tokens/s of each row, and at batch 1 the share of the bandwidth bound."""
    rows = [k for k in ("kv", "kv_plain", "kv_order", "nokv", "hf", "hf_copied") if k in res]
    other = "Megatron's order" if res["step_order"] else "the step's order"
    same = all(res[k][1] == res["kv"][1] for k in rows)
    print(f"greedy decode, {a.shape} shape ({params / 1e6:.1f}M parameters), batch {a.batch}, "
          f"prompt {a.prompt_tokens} + {a.new_tokens} new tokens, fp32, {res['threads']} "
          f"threads; tokens identical: {same}")  # fmt: skip
    new = a.new_tokens * a.batch  # tokens/s counts every row's new tokens
    kv = new / res["kv"][0]
    print(f"{'run':<34}{'seconds':>9}{'tokens/s':>10}{'KV cache is':>14}")
    for label, key in (("anyspeed, KV cache", "kv"), ("  without packed weights", "kv_plain"),
                       (f"  cache in {other}", "kv_order"), ("anyspeed, no KV cache", "nokv"),
                       ("transformers generate (mmap'd)", "hf"),
                       ("transformers generate (copied)", "hf_copied")):  # fmt: skip
        if key in res:
            tps = new / res[key][0]
            print(f"{label:<34}{res[key][0]:>9.2f}{tps:>10.1f}{kv / tps:>13.2f}x")
    if "read" in res:
        size = params * 4
        # the decode steps alone: the whole run less a run that only prefills (1 new token)
        step = (a.new_tokens - 1) / (res["kv"][0] - res["prefill"][0])
        print(f"anyspeed's decode steps alone (without the {res['prefill'][0]:.2f} s prefill): "
              f"{step:.1f} tokens/s")  # fmt: skip
        for key in ("read", "copy"):
            gbs = size / res[key][1]  # the row's fastest pass
            bound = gbs / size  # tokens/s if a step only streamed the weights once
            print(f"bandwidth ({key} of {size / 1e6:.0f} MB, this thread): {gbs / 1e9:.1f} GB/s;"
                  f" bound {bound:.1f} tokens/s; the decode steps at {step / bound:.0%} of it,"
                  f" the whole run at {kv / bound:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
