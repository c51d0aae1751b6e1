"""``train-tokenizer``: a byte-level BPE trained locally and saved as an HF tokenizer directory."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

from anyspeed.data.errors import DataError, RecordError, UsageError
from anyspeed.data.readers import Reader, decode_item, resolve_inputs

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD, "<|im_start|>", "<|im_end|>"]
# ChatML; with ``tools``, a system turn lists their JSON schemas and how to call one, an
# assistant turn's ``tool_calls`` are written hermes-style and a tool's answer is a ``tool``
# turn (plain conversations render as before).
CHAT_TEMPLATE = (
    "{% set ns = namespace(skip=false) %}"
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% set ns.skip = true %}{% endif %}"
    '{{ \'Tools you can call, one <tool_call>{"name": ..., "arguments": {...}}</tool_call> \''
    " + 'per call:\\n' }}"
    "{% for t in tools %}{{ t | tojson + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if not (loop.first and ns.skip) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for c in message.tool_calls or [] %}"
    "{{ '<tool_call>\\n' + {'name': c['function']['name'], 'arguments': "
    "c['function']['arguments']} | tojson + '\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _Counts:
    """Records read and texts kept, so an unusable corpus is an error, not a bytes-only BPE."""

    def __init__(self) -> None:
        self.records = 0
        self.texts = 0


def iter_texts(
    inputs: list[str],
    json_keys: list[str],
    fmt: str | None = None,
    batch: int = 1000,
    counts: _Counts | None = None,
) -> Iterator[list[str]]:
    """Batches of document strings from files/globs/directories; unusable records are skipped
    (a file that cannot be read to its end raises DataError)."""
    counts = counts or _Counts()
    for spec in inputs:
        for f in resolve_inputs(spec, fmt):
            texts: list[str] = []
            for _, kind, payload in Reader(f, json_keys):
                counts.records += 1
                try:
                    rec = decode_item(kind, payload, json_keys[0])
                except RecordError:
                    continue
                values = (rec.get(k) for k in json_keys)
                texts += [v for v in values if isinstance(v, str) and v.strip()]
                if len(texts) >= batch:
                    counts.texts += len(texts)
                    yield texts
                    texts = []
            if texts:
                counts.texts += len(texts)
                yield texts


def _check_output_dir(output_dir: str, overwrite: bool) -> None:
    """Refuse an existing tokenizer (without --overwrite) or an unwritable place; makes nothing."""
    if os.path.exists(os.path.join(output_dir, "tokenizer.json")) and not overwrite:
        raise UsageError(f"{output_dir!r} already holds a tokenizer; pass --overwrite")
    probe = os.path.abspath(output_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"--output-dir {output_dir!r}: {probe!r} is not a directory")
    if not os.access(probe, os.W_OK):
        raise UsageError(f"output directory {output_dir!r} is not writable")


def _save(hf: object, output_dir: str) -> None:
    """Save into a temporary sibling directory, then move the files into place: a failed
    save leaves neither a half-written tokenizer nor an empty directory."""
    tmp = f"{os.path.abspath(output_dir).rstrip(os.sep)}.tmp-{os.getpid()}"
    try:
        hf.save_pretrained(tmp)  # type: ignore[attr-defined]
        if not os.path.isdir(output_dir):
            os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)
            os.rename(tmp, output_dir)
            return
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def train_tokenizer(
    inputs: list[str],
    output_dir: str,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    json_keys: list[str] | None = None,
    input_format: str | None = None,
    overwrite: bool = False,
) -> str:
    """Train a byte-level BPE on the inputs and save it where AutoTokenizer can load it.

    A corpus with no usable text is a DataError, and nothing is written."""
    keys = json_keys or ["text"]
    for spec in inputs:
        resolve_inputs(spec, input_format)  # fail early on a bad --input
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise UsageError(f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)}")
    _check_output_dir(output_dir, overwrite)

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
    counts = _Counts()
    tok.train_from_iterator(iter_texts(inputs, keys, input_format, counts=counts), trainer=trainer)
    if not counts.texts:
        raise DataError(
            f"--input holds no usable text under --json-keys {' '.join(keys)} "
            f"({counts.records} records read); no tokenizer was written"
        )
    if tok.get_vocab_size() < vocab_size:
        print(
            f"anyspeed train-tokenizer: warning: the corpus gave {tok.get_vocab_size()} of the "
            f"{vocab_size} tokens asked (too little text)",
            file=sys.stderr,
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    hf.chat_template = CHAT_TEMPLATE
    _save(hf, output_dir)
    return output_dir
