"""``anyspeed demo --mm --family qwen2_5_vl`` (or ``qwen2_vl``): a Qwen-VL model, offline, on N
CPU processes.

1. images: shapes of five colours drawn with pillow on the left or right, at two picture sizes
   (the tower sees each at its own resolution), captioned from what was drawn; a held-out set;
2. a tiny random Hugging Face Qwen2.5-VL (window-attention tower, mRoPE) and a word tokenizer
   with Qwen's chat and vision tokens;
3. ``anyspeed posttrain --stage vlm`` from it on the ``mllm`` records, data parallel;
4. held-out captions (greedy, KV cache), exactly right before and after training.

It fails (exit 1) unless the caption loss fell by at least half and held-out accuracy rose.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from anyspeed.demo import qwen_vl_data as Q
from anyspeed.demo.common import fresh_metrics, loss_halved
from anyspeed.demo.mm import TRAIN, train_vlm

SEQ = "64"  # the chat frame, an image's 12 or 16 vision tokens and the caption


def _accuracy(ckpt: str, held: str, folder: str, hf: str) -> tuple[int, list[tuple[str, str]]]:
    """(exactly right, (truth, caption) pairs) of greedy captions of the held-out pictures."""
    import torch

    from anyspeed.commands.session import load_model, model_of
    from anyspeed.convert.megatron_io import megatron_session
    from anyspeed.data.qwen_vl_pixels import Pixels
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.inference.generate import decode
    from anyspeed.inference.qwen_vl import generate
    from anyspeed.layout import Layout
    from anyspeed.stages.vlm.qwen_data import Vision, render, vision_inputs

    tok = load_tokenizer(TokenizerSpec(name_or_path=hf))
    records = json.loads(open(held, encoding="utf-8").read())
    head = tok.encode(["<|im_start|>assistant\n"], special=False)[0]
    pairs = []
    with megatron_session():
        spec = model_of(ckpt)
        (model,) = load_model(ckpt, spec, Layout())
        vision = Vision.of(spec.hf_config, spec.processor)
        pixels, markers = Pixels(spec.processor), vision.markers

        def pick(logits: torch.Tensor) -> torch.Tensor:
            logits[:, markers] = -float("inf")
            return logits.argmax(-1)

        for r in records:
            question = dict(r, messages=r["messages"][:1])
            sample, _ = render(question, folder, tok, vision, 1 << 30)
            inputs = vision_inputs(list(sample.images), [], pixels, True)
            ids = torch.tensor([sample.tokens + head])
            out = generate(model, ids, inputs, 10, Q.VOCAB, (tok.eod_id,), pick)[0]
            pairs.append((r["messages"][1]["content"], decode(tok, out)))
    return sum(truth == got for truth, got in pairs), pairs


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole Qwen-VL demo; ``extra`` goes to ``anyspeed posttrain``."""
    from anyspeed.convert.qwen_vl_api import hf_to_megatron

    t0 = time.perf_counter()
    work, kind = args.workdir, args.family
    train = Q.make_records(work, 512, 0, "train")
    held = Q.make_records(work, 32, 1, "heldout")
    print(f"[1/4] images: 512 captioned pictures at two sizes ({train}), 32 held out ({held})")
    hf = Q.make_model(os.path.join(work, "hf"), kind, width=128)
    print(f"[2/4] a random tiny {kind} (window-attention tower, mRoPE) and a word tokenizer: {hf}")
    start = str(hf_to_megatron(hf, os.path.join(work, "start")))
    before, _ = _accuracy(start, held, work, hf)
    save = os.path.join(work, "vlm-checkpoints")
    metrics = fresh_metrics(os.path.join(work, "vlm-metrics.jsonl"))
    flags = [*TRAIN]
    flags[flags.index("--seq-length") + 1] = SEQ
    rc = train_vlm(args, hf, train, save, metrics, flags, extra)
    if rc:
        return rc
    ok = loss_halved(metrics, "caption loss")
    after, pairs = _accuracy(save, held, work, hf)
    print(
        f"[4/4] held-out captions exactly right: {before}/{len(pairs)} before training, "
        f"{after}/{len(pairs)} after"
    )
    for truth, got in pairs[:3]:
        print(f"  drawn: {truth!r:34} caption: {got!r}")
    rc = 0 if ok and after > before else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
