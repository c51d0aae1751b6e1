"""Tokenizer front-ends (HF, SentencePiece, GPT-2 BPE) behind one batch-encoding interface."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from anyspeed.data.errors import UsageError

TOKENIZER_TYPES = ("PretrainedFromHF", "SentencePieceTokenizer", "GPT2BPETokenizer")
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
_PROBES = ("Hello world! ", "  multiple   spaces\tand\nnewlines ", "naïve café 日本語 123")


@dataclass(frozen=True)
class TokenizerSpec:
    """Picklable description of a tokenizer so worker processes can rebuild it."""

    kind: str = "PretrainedFromHF"
    name_or_path: str | None = None
    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None

    def check(self) -> None:
        """Fail early (UsageError) when a needed flag is missing or a path does not exist."""
        need = {
            "PretrainedFromHF": [("--tokenizer-name-or-path", self.name_or_path)],
            "SentencePieceTokenizer": [("--tokenizer-model", self.model)],
            "GPT2BPETokenizer": [
                ("--vocab-file", self.vocab_file),
                ("--merge-file", self.merge_file),
            ],
        }
        if self.kind not in need:
            raise UsageError(
                f"unknown --tokenizer-type {self.kind!r}; choose from {', '.join(TOKENIZER_TYPES)}"
            )
        for flag, value in need[self.kind]:
            if not value:
                raise UsageError(f"--tokenizer-type {self.kind} needs {flag}")
            if not os.path.exists(value):
                raise UsageError(f"{flag} {value!r}: no such file or directory (no hub downloads)")


class Tokenizer:
    """Batch encoder with vocabulary size, end-of-document and padding ids."""

    vocab_size: int
    eod_id: int | None
    pad_id: int | None
    name: str

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """Token ids for each text; ``special`` adds the tokenizer's own BOS/EOS rules."""
        raise NotImplementedError

    @property
    def has_chat_template(self) -> bool:
        """Whether ``render_chat`` can use a template shipped with the tokenizer."""
        return False

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None
    ) -> str:
        """Render messages (and the JSON schemas of ``tools`` the model may call) with the
        tokenizer's own chat template."""
        raise UsageError(f"tokenizer {self.name} has no chat template; pass --prompt-type")


class _RustTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (tokenizer.json or GPT-2 vocab+merges), batch-encoded natively."""

    def __init__(self, tok: Any, name: str, eod: int | None = None, pad: int | None = None):
        self.tok = tok
        self.name = name
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        vocab = tok.get_vocab(with_added_tokens=True)
        if eod is None:
            eod = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        self.eod_id = eod
        self.pad_id = pad if pad is not None else (vocab.get("<|pad|>", vocab.get("<pad>", eod)))

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=special)]


class _HFTokenizer(Tokenizer):
    """A transformers tokenizer from a local directory; uses its Rust backend when equivalent."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise UsageError(
                f"cannot load tokenizer from {path!r}: {exc}".splitlines()[0]
            ) from None
        self.name = path
        self.vocab_size = len(self.hf)
        self.eod_id = self.hf.eos_token_id
        self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eod_id
        self.backend = getattr(self.hf, "backend_tokenizer", None)
        if self.backend is not None:
            for probe in _PROBES:
                for special in (True, False):
                    slow = self.hf(probe, add_special_tokens=special)["input_ids"]
                    if slow != self.backend.encode(probe, add_special_tokens=special).ids:
                        self.backend = None

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        if self.backend is not None:
            return [
                e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=special)
            ]
        return self.hf(texts, add_special_tokens=special)["input_ids"]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None
    ) -> str:
        if not self.has_chat_template:
            return super().render_chat(messages, add_generation_prompt, tools)
        return self.hf.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )


class _SentencePiece(Tokenizer):
    """A SentencePiece model; batches go through its C++ encoder on one thread."""

    def __init__(self, path: str):
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as exc:
            raise UsageError(f"cannot load SentencePiece model {path!r}: {exc}") from None
        self.name = path
        self.vocab_size = self.sp.vocab_size()
        eos, pad = self.sp.eos_id(), self.sp.pad_id()
        self.eod_id = eos if eos >= 0 else None
        self.pad_id = pad if pad >= 0 else self.eod_id

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=1)


_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>")


def end_ids(tok: Any) -> tuple[int, ...]:
    """EOS and the chat templates' end-of-turn tokens the vocabulary has: where a generated
    answer ends."""
    vocab = tok.hf.get_vocab() if getattr(tok, "hf", None) is not None else {}
    ids = {vocab[t] for t in _END_TOKENS if t in vocab}
    if tok.eod_id is not None:
        ids.add(tok.eod_id)
    return tuple(sorted(ids))


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Build the tokenizer a spec describes (local files only)."""
    spec.check()
    if spec.kind == "SentencePieceTokenizer":
        return _SentencePiece(spec.model)  # type: ignore[arg-type]
    from tokenizers import Tokenizer as RustTokenizer

    if spec.kind == "GPT2BPETokenizer":
        from tokenizers import decoders, models, pre_tokenizers

        try:
            bpe = models.BPE.from_file(spec.vocab_file, spec.merge_file)
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise UsageError(f"cannot load GPT-2 vocab/merges: {exc}") from None
        tok = RustTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        with open(spec.vocab_file, encoding="utf-8") as fh:  # type: ignore[arg-type]
            eod = json.load(fh).get("<|endoftext|>")
        return _RustTokenizer(tok, spec.vocab_file, eod=eod)  # type: ignore[arg-type]
    path = spec.name_or_path
    assert path is not None
    if os.path.isfile(path):
        try:
            return _RustTokenizer(RustTokenizer.from_file(path), path)
        except Exception as exc:  # a file that is not tokenizer.json
            raise UsageError(f"cannot load tokenizer file {path!r}: {exc}") from None
    return _HFTokenizer(path)
