"""``train-tokenizer``: a byte-level BPE trained locally and saved as an HF tokenizer directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

from anyspeed.data.errors import RecordError, UsageError
from anyspeed.data.readers import Reader, decode_item, resolve_inputs

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD, "<|im_start|>", "<|im_end|>"]
# ChatML-style: every message is wrapped in <|im_start|>role ... <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def iter_texts(
    inputs: list[str], json_keys: list[str], fmt: str | None = None, batch: int = 1000
) -> Iterator[list[str]]:
    """Batches of document strings from files/globs/directories; unusable records are skipped."""
    for spec in inputs:
        for f in resolve_inputs(spec, fmt):
            texts: list[str] = []
            for _, kind, payload in Reader(f, json_keys):
                try:
                    rec = decode_item(kind, payload, json_keys[0])
                except RecordError:
                    continue
                texts += [rec[k] for k in json_keys if isinstance(rec.get(k), str)]
                if len(texts) >= batch:
                    yield texts
                    texts = []
            if texts:
                yield texts


def train_tokenizer(
    inputs: list[str],
    output_dir: str,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    json_keys: list[str] | None = None,
    input_format: str | None = None,
    overwrite: bool = False,
) -> str:
    """Train a byte-level BPE on the inputs and save it where AutoTokenizer can load it."""
    keys = json_keys or ["text"]
    for spec in inputs:
        resolve_inputs(spec, input_format)  # fail early on a bad --input
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise UsageError(f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)}")
    if os.path.exists(os.path.join(output_dir, "tokenizer.json")) and not overwrite:
        raise UsageError(f"{output_dir!r} already holds a tokenizer; pass --overwrite")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {output_dir!r}: {exc.strerror}") from None
    if not os.access(output_dir, os.W_OK):
        raise UsageError(f"output directory {output_dir!r} is not writable")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(inputs, keys, input_format), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(output_dir)
    return output_dir
