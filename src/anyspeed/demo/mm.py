"""``anyspeed demo --mm``: a vision-language model, offline, on N CPU processes.

1. images: shapes of five colours drawn with pillow on the left or right of 32x32 pictures,
   each captioned from what was drawn ("a red circle on the left"); a held-out set too;
2. a tiny random Hugging Face LLaVA (LLaMA language model, CLIP tower) and a word tokenizer;
3. ``anyspeed posttrain --stage vlm`` from it, data parallel over the processes;
4. the trained checkpoint captions the held-out pictures (greedy).

It fails (exit 1) unless the caption loss fell by at least half.
"""

from __future__ import annotations

import argparse
import os
import time

from anyspeed.demo import mm_data as D
from anyspeed.demo.common import fresh_metrics, loss_halved

TRAIN = [
    "--micro-batch-size",
    "8",
    "--lr",
    "2e-3",
    "--min-lr",
    "2e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "10",
    "--weight-decay",
    "0.0",
    "--clip-grad",
    "1.0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--split",
    "100,0,0",
    "--seq-length",
    "48",
    "--log-interval",
    "20",
    "--make-vocab-size-divisible-by",
    "1",
]


def _captions(save: str, held: str, folder: str) -> list[tuple[str, str]]:
    """(truth, generated) for every held-out picture."""
    import json

    import torch

    from anyspeed.commands.session import load_model, model_of
    from anyspeed.convert.megatron_io import megatron_session
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.inference.vlm import greedy
    from anyspeed.layout import Layout
    from anyspeed.stages.vlm.data import load_image, render

    tok = load_tokenizer(TokenizerSpec(name_or_path=os.path.join(folder, "hf")))
    records = [json.loads(line) for line in open(held, encoding="utf-8")]
    question = dict(records[0], conversations=records[0]["conversations"][:1])
    prompt, _ = render(question, tok, D.IMAGE_TOKEN)
    prompt += tok.encode(["ASSISTANT: "], special=False)[0]
    images = torch.stack(
        [load_image(os.path.join(folder, r["image"]), D.IMAGE_SIZE, "clip") for r in records]
    )
    with megatron_session():
        (model,) = load_model(save, model_of(save), Layout())
        rows = greedy(model, images, prompt, 10, D.VOCAB, (tok.eod_id,))
    import tokenizers

    dec = tokenizers.Tokenizer.from_file(os.path.join(folder, "hf", "tokenizer.json"))
    truths = [r["conversations"][1]["value"] for r in records]
    return [(t, dec.decode(row)) for t, row in zip(truths, rows, strict=True)]


def train_vlm(
    args: argparse.Namespace,
    hf: str,
    data: str,
    save: str,
    metrics: str,
    flags: list[str],
    extra: list[str],
) -> int:
    """``anyspeed posttrain --stage vlm`` from ``hf`` on the demo's processes, data parallel
    (8 samples a process a step), saving at the end; its exit code."""
    from anyspeed.commands.train import posttrain as posttrain_main

    n, iters = args.nproc_per_node, args.train_iters or 200
    cmd = ["--nproc-per-node", str(n), "--stage", "vlm", "--load", hf, "--data-path", data]
    cmd += ["--global-batch-size", str(8 * n), "--train-iters", str(iters), *flags]
    cmd += ["--save", save, "--save-interval", str(iters), "--metrics-file", metrics, *extra]
    print(f"[3/4] anyspeed posttrain {' '.join(cmd)}", flush=True)
    return posttrain_main(cmd)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole multimodal demo; ``extra`` goes to ``anyspeed posttrain``."""
    t0 = time.perf_counter()
    work = args.workdir
    train = D.make_records(work, 512, 0, "train")
    held = D.make_records(work, 32, 1, "heldout")
    print(f"[1/4] images: 512 captioned pictures ({train}), 32 held out ({held})")
    hf = D.make_model(os.path.join(work, "hf"))
    print(f"[2/4] a random tiny LLaVA (LLaMA + CLIP tower) and a word tokenizer: {hf}")
    save = os.path.join(work, "vlm-checkpoints")
    metrics = fresh_metrics(os.path.join(work, "vlm-metrics.jsonl"))
    rc = train_vlm(args, hf, train, save, metrics, TRAIN, extra)
    if rc:
        return rc
    ok = loss_halved(metrics, "caption loss")
    pairs = _captions(save, held, work)
    right = sum(t == g for t, g in pairs)
    print(f"[4/4] held-out captions exactly right: {right}/{len(pairs)}")
    for truth, got in pairs[:3]:
        print(f"  drawn: {truth!r:34} caption: {got!r}")
    rc = 0 if ok else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
