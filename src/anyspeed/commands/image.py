"""``anyspeed generate --image FILE``: what a vision-language model says about images, with the
KV cache, through the same runner as every model (any TP; PP is refused). A LLaVA model answers
greedily, one row per image; a Qwen-VL model (:mod:`anyspeed.commands.qwen_image`) once for all
``--image`` and ``--video`` inputs together, greedy or sampled."""

from __future__ import annotations

import argparse
from typing import Any

from anyspeed.commands import session
from anyspeed.distributed.process import print0
from anyspeed.errors import UsageError
from anyspeed.layout import Layout

DEFAULT_PROMPT = "what is in the picture?"


def check_files(args: argparse.Namespace) -> None:
    """Every ``--image`` is there, within ``--max-image-pixels`` and decodes (one line naming
    the file otherwise), before any model work; only the headers are read."""
    from anyspeed.stages.vlm.data import image_problem

    if args.max_image_pixels < 1:
        raise UsageError("--max-image-pixels must be >= 1")
    from anyspeed.commands.qwen_image import video_frames

    frames = [f for v in args.video for f in video_frames(v)]
    for f in [*args.image, *frames]:
        why = image_problem(f, args.max_image_pixels)
        if why is not None:
            reason = "no such file" if why[0] == "missing image" else why[1]
            raise UsageError(f"--image {f!r}: {reason}")


def check(args: argparse.Namespace, model: Any) -> None:
    """The flags of a generation from images (one line for what does not apply)."""
    if session.is_qwen_vl(model):
        from anyspeed.commands.qwen_image import check as check_qwen

        check_qwen(args, model)
        return
    if args.video:
        raise UsageError(f"--video: --load {args.load!r} is a LLaVA model (images only)")
    if not session.is_llava(model):
        raise UsageError(
            f"--image: --load {args.load!r} holds a text-only model; drop --image "
            "or load a LLaVA model"
        )
    if not args.image:
        raise UsageError(f"--load {args.load!r} holds a LLaVA model: pass --image FILE")
    if args.pipeline_model_parallel_size != 1:
        raise UsageError(
            "--pipeline-model-parallel-size: generation from images runs with "
            "tensor parallelism only (the tower sits on the first stage)"
        )
    if args.task != "greedy" or args.stop or args.prompts_file or len(args.prompt) > 1:
        raise UsageError(
            "--image: greedy generation with at most one --prompt (no --task, "
            "--stop or --prompts-file)"
        )
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be positive")
    try:
        from anyspeed.models.multimodal import check_layout

        check_layout(model, Layout(tp=args.tensor_model_parallel_size))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def generate(run: session.InferenceRun, chunks: list) -> None:
    """Print each image's greedy answer (rank 0)."""
    import torch

    if session.is_qwen_vl(run.model):
        from anyspeed.commands.qwen_image import generate as generate_qwen

        generate_qwen(run, chunks)
        return

    from anyspeed.checkpoint.record import hf_vocab
    from anyspeed.device import torch_device
    from anyspeed.inference.generate import decode
    from anyspeed.inference.vlm import greedy
    from anyspeed.stages.vlm.data import load_image, render

    args, tok, cfg = run.args, run.tokenizer, run.model
    text = args.prompt[0] if args.prompt else DEFAULT_PROMPT
    turn = text if "<image>" in text else f"<image>\n{text}"
    prompt, _ = render(
        {"conversations": [{"from": "human", "value": turn}]}, tok, cfg.image_token_id
    )
    prompt += tok.encode(["ASSISTANT: "], special=False)[0]
    v = cfg.vision
    model = chunks[0]
    images = torch.stack([load_image(f, v.image_size, v.kind) for f in args.image])
    images = images.to(device=torch_device(), dtype=next(model.parameters()).dtype)
    ends = (tok.eod_id,) if tok.eod_id is not None else ()
    # the HF model's rows (a converted checkpoint records them): the padding rows never win
    vocab = hf_vocab(run.load) or cfg.language.vocab_size
    rows = greedy(model, images, prompt, args.max_new_tokens, vocab, ends, args.use_kv_cache)
    fast = getattr(tok, "backend", None)  # the tokenizer.json's own decoder, as the vlm stage
    for f, row in zip(args.image, rows, strict=True):
        print0(f"image: {f}\n{fast.decode(row) if fast else decode(tok, row)}\n")
