"""``anyspeed generate --image FILE --prompt TEXT``: a LLaVA model describes or answers about
images, greedily, with the KV cache. ``--load`` is a ``vlm`` checkpoint, a converted LLaVA
checkpoint or a Hugging Face LLaVA directory (converted in memory). One process (TP1).

The prompt is rendered as the ``vlm`` stage trains: ``USER: <image>\\n{prompt}\\nASSISTANT: ``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from anyspeed.errors import OneLineArgumentParser, UsageError, report

PROG = "anyspeed generate"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True,
                   help="vlm / converted LLaVA checkpoint, or HF LLaVA directory")  # fmt: skip
    p.add_argument("--image", action="append", required=True, help="an image file (repeatable)")
    p.add_argument("--prompt", default="what is in the picture?")
    p.add_argument("--tokenizer-name-or-path", default=None,
                   help="HF tokenizer directory (default: --load when it holds one)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--use-kv-cache", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--task", choices=["greedy"], default="greedy")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    return p


def _check(args: argparse.Namespace) -> str:
    """The tokenizer directory; UsageError for a bad flag or image, before any model work."""
    if args.tensor_model_parallel_size != 1:
        raise UsageError("--image: generation with a LLaVA model runs in one process; drop "
                         "--tensor-model-parallel-size")  # fmt: skip
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be positive")
    tok = args.tokenizer_name_or_path or args.load
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        raise UsageError(f"--tokenizer-name-or-path: no tokenizer.json in {tok!r}")
    from PIL import Image

    for f in args.image:
        try:
            with Image.open(f) as im:
                im.verify()
        except FileNotFoundError:
            raise UsageError(f"--image {f!r}: no such file") from None
        except Exception as exc:  # noqa: BLE001 - any decoder failure
            raise UsageError(f"--image {f!r}: cannot be decoded ({type(exc).__name__})") from None
    return tok


def _model(load: str) -> tuple[Any, Any]:
    """(LLaVAModel, LlavaConfig) of ``load``; inside a megatron session."""
    import torch

    from anyspeed.convert import is_hf_dir
    from anyspeed.convert import llava as conv
    from anyspeed.convert.llava_api import build_model, load_megatron
    from anyspeed.models.vision import llava_from_hf

    if not is_hf_dir(load):
        model, cfg, _ = load_megatron(load)
        return model, cfg
    from anyspeed.convert.hf_io import HFCheckpoint

    ck = HFCheckpoint(load)
    cfg = llava_from_hf(ck.config)
    layout = conv.layout_of(ck.names)
    model = build_model(cfg, torch.float32)
    state = conv.to_megatron(cfg, lambda n: ck.get(conv.hf_name(n, layout)).float(),
                             cfg.language.vocab_size)  # fmt: skip
    conv.load_into(model, state, 1, 0)
    return model.eval(), cfg


def main(argv: Sequence[str] | None = None) -> int:
    from anyspeed import quiet

    quiet.install()
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        tok_dir = _check(args)
    except UsageError as exc:
        return report(PROG, exc)
    import torch

    from anyspeed.convert.errors import ConvertError
    from anyspeed.convert.megatron_io import megatron_session
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.inference.vlm import greedy
    from anyspeed.stages.vlm.data import load_image, render

    tok = load_tokenizer(TokenizerSpec(name_or_path=tok_dir))
    try:
        with megatron_session():
            model, cfg = _model(args.load)
            v = cfg.vision
            turn = args.prompt if "<image>" in args.prompt else f"<image>\n{args.prompt}"
            prompt, _ = render({"conversations": [{"from": "human", "value": turn}]}, tok,
                               cfg.image_token_id)  # fmt: skip
            prompt += tok.encode(["ASSISTANT: "], special=False)[0]
            images = torch.stack([load_image(f, v.image_size, v.kind) for f in args.image])
            ends = (tok.eod_id,) if tok.eod_id is not None else ()
            rows = greedy(model, images.to(next(model.parameters()).dtype), prompt,
                          args.max_new_tokens, cfg.language.vocab_size, ends,
                          args.use_kv_cache)  # fmt: skip
    except (ValueError, ConvertError) as exc:
        return report(PROG, UsageError(f"--load {args.load!r}: {exc}"), code=1)
    import tokenizers

    dec = tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    for f, row in zip(args.image, rows, strict=True):
        print(f"image: {f}\n{dec.decode(row)}\n")
    return 0
