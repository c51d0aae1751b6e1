"""``anyspeed generate --image FILE [--video DIR] --prompt TEXT`` for Qwen2-VL / Qwen2.5-VL: one
answer about every input together, rendered as the ``vlm`` stage trains (Qwen's chat format, the
images then the videos before the text), greedy or sampled, with the KV cache and the mRoPE
decoding offset (:mod:`anyspeed.inference.qwen_vl`). The vision marker tokens (pads, start,
end) are never generated."""

from __future__ import annotations

import argparse
from typing import Any

from anyspeed.commands import session
from anyspeed.distributed.process import print0
from anyspeed.errors import UsageError

DEFAULT_PROMPT = "what is in the picture?"


def check(args: argparse.Namespace, spec: Any) -> None:
    """One line for what a Qwen-VL generation does not take."""
    if not args.image and not args.video:
        raise UsageError(f"--load {args.load!r} holds a Qwen-VL model: pass --image or --video")
    if args.pipeline_model_parallel_size != 1:
        raise UsageError(
            "--pipeline-model-parallel-size: generation from images runs with tensor "
            "parallelism only (the tower sits on the first stage)"
        )
    if args.task not in ("greedy", "do_sample") or args.stop or args.prompts_file:
        raise UsageError(
            "--image: --task greedy or do_sample with at most one --prompt (no --stop or "
            "--prompts-file)"
        )
    if len(args.prompt) > 1:
        raise UsageError("--prompt: one prompt about the inputs (given several)")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be positive")
    from anyspeed.commands.prompting import sampling_params

    try:
        sampling_params(args).check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from anyspeed.models.multimodal import check_tower_tp

    try:
        check_tower_tp(
            spec.tower.num_heads, spec.tower.ffn_hidden_size, args.tensor_model_parallel_size
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def video_frames(folder: str) -> list[str]:
    """A ``--video`` folder's frame images in name order (one line when there are none)."""
    import os

    from anyspeed.stages.vlm.qwen_data import IMAGE_SUFFIXES

    if not os.path.isdir(folder):
        raise UsageError(f"--video {folder!r}: not a folder of frame images")
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_SUFFIXES))
    if not names:
        raise UsageError(f"--video {folder!r}: holds no frame image ({', '.join(IMAGE_SUFFIXES)})")
    return [os.path.join(folder, n) for n in names]


def prompt_ids(args: argparse.Namespace, tok: Any, spec: Any) -> tuple[list[int], Any]:
    """The rendered prompt's tokens (vision blocks expanded) and its Sample."""
    from anyspeed.stages.vlm.qwen_data import Vision, render

    c, t, p = spec.hf_config, spec.tower, spec.processor
    vision = Vision(c["image_token_id"], c["video_token_id"], c["vision_start_token_id"],
                    c["vision_end_token_id"], t.patch_size, t.spatial_merge_size,
                    t.temporal_patch_size, p["min_pixels"], p["max_pixels"])  # fmt: skip
    text = args.prompt[0] if args.prompt else DEFAULT_PROMPT
    tags = "<image>" * len(args.image) + "<video>" * len(args.video)
    record = {
        "messages": [{"role": "user", "content": tags + text}],
        "images": list(args.image),
        "videos": [video_frames(v) for v in args.video],
    }
    try:
        sample, _ = render(record, "", tok, vision, args.max_image_pixels)
    except ValueError as exc:
        raise UsageError(f"--image/--video: {exc}") from None
    head = tok.encode(["<|im_start|>assistant\n"], special=False)[0]
    return sample.tokens + head, sample


def generate(run: session.InferenceRun, chunks: list) -> None:
    """Print the answer (rank 0)."""
    import torch

    from anyspeed.checkpoint.record import hf_vocab
    from anyspeed.commands.prompting import sampling_params
    from anyspeed.data.qwen_vl_pixels import Pixels
    from anyspeed.device import torch_device
    from anyspeed.inference.generate import decode
    from anyspeed.inference.qwen_vl import generate as decode_ids
    from anyspeed.inference.sampling import next_tokens
    from anyspeed.stages.vlm.qwen_data import vision_inputs

    args, tok, spec = run.args, run.tokenizer, run.model
    ids, sample = prompt_ids(args, tok, spec)
    qwen25 = spec.tower.kind == "qwen2_5_vl"
    pixels = Pixels(spec.processor)
    vision = vision_inputs(list(sample.images), list(sample.videos), pixels, qwen25)
    model, device = chunks[0], torch_device()
    dtype = next(model.parameters()).dtype
    vision = {k: v.to(device) for k, v in vision.items()}
    for k in ("pixel_values", "pixel_values_videos"):
        if k in vision:
            vision[k] = vision[k].to(dtype)
    params, g = sampling_params(args), torch.Generator().manual_seed(args.seed)

    c = spec.hf_config
    markers = [c[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                              "vision_end_token_id")]  # fmt: skip

    def pick(logits: torch.Tensor) -> torch.Tensor:  # the same draw on every TP rank
        logits[:, markers] = -float("inf")  # they mark inputs: never an answer's token
        return next_tokens(logits, params, g).to(logits.device)

    ends = tuple(t for t in (tok.eod_id,) if t is not None)
    vocab = hf_vocab(run.load) or spec.language.vocab_size
    out = decode_ids(model, torch.tensor([ids], device=device), vision, args.max_new_tokens,
                     vocab, ends, pick, use_kv_cache=args.use_kv_cache)  # fmt: skip
    fast = getattr(tok, "backend", None)
    print0(fast.decode(out[0]) if fast else decode(tok, out[0]))
