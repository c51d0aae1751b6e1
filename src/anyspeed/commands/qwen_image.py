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
    if args.task not in ("greedy", "do_sample", "chat") or args.stop:
        raise UsageError("--image: --task greedy, do_sample or chat (no --stop)")
    if args.task != "chat" and (len(args.prompt) > 1 or args.prompts_file):
        raise UsageError(
            "--prompt: one prompt about the inputs (several turns: --task chat, with "
            "--prompt per turn, --prompts-file or stdin)"
        )
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


def vision_of(spec: Any) -> Any:
    """The vision-block rule of the model's config and processor."""
    from anyspeed.stages.vlm.qwen_data import Vision

    return Vision.of(spec.hf_config, spec.processor)


def prompt_ids(
    args: argparse.Namespace, tok: Any, spec: Any, turns: list[dict] | None = None
) -> tuple[list[int], Any]:
    """The rendered conversation's tokens (vision blocks expanded) and its Sample: ``turns``
    (default: the one ``--prompt``), the inputs' tags leading the first user turn."""
    from anyspeed.stages.vlm.qwen_data import render

    if turns is None:
        turns = [{"role": "user", "content": args.prompt[0] if args.prompt else DEFAULT_PROMPT}]
    tags = "<image>" * len(args.image) + "<video>" * len(args.video)
    turns = [dict(turns[0], content=tags + turns[0]["content"]), *turns[1:]]
    record = {
        "messages": turns,
        "images": list(args.image),
        "videos": [video_frames(v) for v in args.video],
    }
    try:
        sample, _ = render(record, "", tok, vision_of(spec), args.max_image_pixels)
    except ValueError as exc:
        raise UsageError(f"--image/--video: {exc}") from None
    head = tok.encode(["<|im_start|>assistant\n"], special=False)[0]
    return sample.tokens + head, sample


class _Answerer:
    """The model's answer to a rendered conversation (its pixels read once)."""

    def __init__(self, run: session.InferenceRun, chunks: list) -> None:
        import torch

        from anyspeed.checkpoint.record import hf_vocab
        from anyspeed.commands.prompting import sampling_params
        from anyspeed.data.qwen_vl_pixels import Pixels
        from anyspeed.device import torch_device
        from anyspeed.stages.vlm.qwen_data import vision_inputs

        args, tok, spec = run.args, run.tokenizer, run.model
        self.run, self.model, self.device = run, chunks[0], torch_device()
        _, sample = prompt_ids(args, tok, spec)
        qwen25 = spec.tower.kind == "qwen2_5_vl"
        vision = vision_inputs(
            list(sample.images), list(sample.videos), Pixels(spec.processor), qwen25
        )
        dtype = next(self.model.parameters()).dtype
        self.vision = {k: v.to(self.device) for k, v in vision.items()}
        for k in ("pixel_values", "pixel_values_videos"):
            if k in self.vision:
                self.vision[k] = self.vision[k].to(dtype)
        self.params, self.g = sampling_params(args), torch.Generator().manual_seed(args.seed)
        self.markers = vision_of(spec).markers
        self.ends = tuple(t for t in (tok.eod_id,) if t is not None)
        self.vocab = hf_vocab(run.load) or spec.language.vocab_size

    def __call__(self, turns: list[dict] | None = None) -> str:
        import torch

        from anyspeed.inference.generate import decode
        from anyspeed.inference.qwen_vl import generate as decode_ids
        from anyspeed.inference.sampling import next_tokens

        args, tok = self.run.args, self.run.tokenizer
        ids, _ = prompt_ids(args, tok, self.run.model, turns)

        def pick(logits: torch.Tensor) -> torch.Tensor:  # the same draw on every TP rank
            logits[:, self.markers] = -float("inf")  # they mark inputs: never an answer's
            return next_tokens(logits, self.params, self.g).to(logits.device)

        out = decode_ids(
            self.model,
            torch.tensor([ids], device=self.device),
            self.vision,
            args.max_new_tokens,
            self.vocab,
            self.ends,
            pick,
            use_kv_cache=args.use_kv_cache,
        )[0]
        fast = getattr(tok, "backend", None)
        return fast.decode(out) if fast else decode(tok, out)


def generate(run: session.InferenceRun, chunks: list) -> None:
    """Print the answer (rank 0); with ``--task chat``, answer turn after turn about the same
    inputs (``--prompt`` per turn, ``--prompts-file`` lines, or stdin until EOF / "exit")."""
    import os

    from anyspeed.commands.chat import read_turn
    from anyspeed.commands.prompting import prompts

    answer = _Answerer(run, chunks)
    if run.args.task != "chat":
        print0(answer())
        return
    turns: list[dict] = []
    given = iter(prompts(run.args))
    scripted = bool(run.args.prompt or run.args.prompts_file)
    while (line := next(given, None) if scripted else read_turn()) is not None:
        if scripted and int(os.environ.get("RANK", "0")) == 0:
            print(f"\nYou >> {line}")
        turns.append({"role": "user", "content": line})
        text = answer(turns)
        print0(f"anyspeed >> {text}")
        turns.append({"role": "assistant", "content": text})
