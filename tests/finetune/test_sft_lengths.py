"""SFT data is never cut or mixed silently (all before any process group): samples longer than
--seq-length are counted and reported, a run with nothing left to learn is refused, data
packed at another --seq-length is refused, and neat-packed rows of one sample are accepted.
The counts are checked against the preprocessed files read back independently."""

from __future__ import annotations

import os

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.prepare import prepare
from helpers.corpora import read_back, write_jsonl
from helpers.instruction import preprocess

VOCAB = 768


def arch(tok: str, seq: int) -> list[str]:
    """A tiny model's flags with the session's tokenizer."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok,
            "--padded-vocab-size", str(VOCAB), "--seq-length", str(seq),
            "--max-position-embeddings", "512"]  # fmt: skip


def _argv(prefix: str, tok: str, seq: int, *extra: str) -> list[str]:
    return ["--stage", "sft", "--is-instruction-dataset", "--data-path", prefix,
            *arch(tok, seq), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--split", "100,0,0", *extra]  # fmt: skip


def _prepare(argv: list[str]):
    os.environ.pop("WORLD_SIZE", None)
    return prepare(argv, "launcher", "posttrain")


def _expected(prefix: str, seq: int) -> tuple[int, int]:
    """(samples longer than seq, samples with no response token in target slots 1..seq-1)."""
    ids = read_back(f"{prefix}_packed_input_ids_document")
    labels = read_back(f"{prefix}_packed_labels_document")
    cut = sum(len(i) > seq for i in ids)
    empty = sum(all(x == -100 for x in lab[1 : min(len(lab), seq)]) for lab in labels)
    return cut, empty


def test_cut_samples_are_counted_before_start(sft_data, capsys):
    prefix, tok = sft_data["padded"], sft_data["tok"]
    lengths = sorted(len(i) for i in read_back(f"{prefix}_packed_input_ids_document"))
    seq = lengths[len(lengths) // 2]  # about half the samples are longer
    cut, empty = _expected(prefix, seq)
    assert cut > 0
    _prepare(_argv(prefix, tok, seq))
    err = capsys.readouterr().err
    assert f"{cut} of {len(lengths)} samples of --data-path {prefix!r} are longer than " in err
    assert f"and cut to it; {empty} keep no response token" in err


def test_nothing_to_learn_is_refused(sft_data):
    prefix, tok = sft_data["padded"], sft_data["tok"]
    assert _expected(prefix, 4)[1] == 8  # every prompt is longer than 4 tokens
    with pytest.raises(UsageError, match="no training sample keeps a response token within "
                       "--seq-length 4"):  # fmt: skip
        _prepare(_argv(prefix, tok, 4))


def test_packed_at_another_length_is_refused(sft_data):
    with pytest.raises(UsageError, match="was packed to sequences of 192 tokens, not "
                       "--seq-length 128: train with --seq-length 192"):  # fmt: skip
        _prepare(_argv(sft_data["packed"], sft_data["tok"], 128, "--neat-pack"))


def test_neat_packed_rows_of_one_sample_are_accepted(sft_data, tmp_path, capsys):
    """Samples too long for two to share a row: each neat-packed row holds one (segment id 1
    and padding 0), which is valid neat-packed data."""
    long = [{"instruction": "word " * 9, "input": "", "output": "reply " * 7}
            for _ in range(3)]  # fmt: skip
    src = write_jsonl(str(tmp_path / "long.jsonl"), long)
    prefix = preprocess(src, str(tmp_path / "one"), sft_data["tok"], "--pack", "--neat-pack",
                        "--seq-length", "192")  # fmt: skip
    segs = read_back(f"{prefix}_packed_attention_mask_document")
    assert len(segs) == 3 and all(max(s) == 1 for s in segs)  # one sample per row
    run, _ = _prepare(_argv(prefix, sft_data["tok"], 192, "--neat-pack",
                            "--reset-attention-mask"))  # fmt: skip
    assert run.config.packed
    assert "holds one segment per row" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("tp", "cp", "asked", "want"),
    [(1, 1, None, 16), (2, 2, None, 64), (1, 1, 1, 1), (2, 1, 8, 8), (2, 2, 3, 24), (4, 1, 2, 4)],
)
def test_pad_to_multiple_of_keeps_what_parallelism_needs(tp, cp, asked, want):
    """``--pad-to-multiple-of N`` rounds variable-length micro-batches to N, and to what
    sequence parallelism (TP) and context parallelism (2 x CP chunks) split evenly."""
    from argparse import Namespace

    from anyspeed.stages.common.instruction_data import pad_length, pad_multiple

    args = Namespace(tensor_model_parallel_size=tp, context_parallel_size=cp,
                     pad_to_multiple_of=asked)  # fmt: skip
    assert pad_multiple(args) == want
    assert (
        pad_length([5, 9], 4096, pad_multiple(args), True) % (tp * (2 * cp if cp > 1 else 1)) == 0
    )
