"""Round trip: every input format -> .bin/.idx -> Megatron's IndexedDataset == tokenizer.encode."""

from __future__ import annotations

import gzip
import json
import os
import struct

import numpy as np
import pytest

from helpers.corpora import (
    dataset_dtype,
    files_bytes,
    leftovers,
    make_docs,
    read_back,
    run_cli,
    write_jsonl,
)

DOCS = make_docs(120, seed=7)
DOCS_NL = make_docs(120, seed=8, newlines=True)  # documents that contain newlines


def _write(fmt: str, d: str) -> tuple[str, list[str], list[str]]:
    """Write DOCS (or DOCS_NL) in one format; returns (--input, extra flags, expected docs)."""
    import pyarrow as pa

    if fmt == "jsonl":
        return (
            write_jsonl(f"{d}/in.jsonl", [{"text": t, "id": i} for i, t in enumerate(DOCS_NL)]),
            [],
            DOCS_NL,
        )
    if fmt == "json-array":
        with open(f"{d}/in.json", "w", encoding="utf-8") as fh:
            json.dump([{"text": t} for t in DOCS_NL], fh, ensure_ascii=False, indent=2)
        return f"{d}/in.json", [], DOCS_NL
    if fmt == "json-lines":  # a .json file holding JSON lines
        return write_jsonl(f"{d}/in.json", [{"text": t} for t in DOCS_NL]), [], DOCS_NL
    if fmt == "jsonl.gz":
        with gzip.open(f"{d}/in.jsonl.gz", "wt", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in DOCS_NL)
        return f"{d}/in.jsonl.gz", [], DOCS_NL
    if fmt == "jsonl.zst":
        import zstandard

        raw = "".join(json.dumps({"text": t}) + "\n" for t in DOCS_NL).encode()
        with open(f"{d}/in.jsonl.zst", "wb") as fh:
            fh.write(zstandard.ZstdCompressor().compress(raw))
        return f"{d}/in.jsonl.zst", [], DOCS_NL
    table = pa.table({"id": list(range(len(DOCS_NL))), "text": DOCS_NL})
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, f"{d}/in.parquet", row_group_size=25)
        return f"{d}/in.parquet", [], DOCS_NL
    if fmt in ("arrow", "arrow-stream"):
        path = f"{d}/in.arrow"
        with pa.OSFile(path, "wb") as sink:
            opener = pa.ipc.new_file if fmt == "arrow" else pa.ipc.new_stream
            with opener(sink, table.schema) as w:
                for batch in table.to_batches(max_chunksize=30):
                    w.write_batch(batch)
        return path, [], DOCS_NL
    if fmt == "csv":
        import csv

        with open(f"{d}/in.csv", "w", encoding="utf-8", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["id", "text"])
            w.writerows([i, t] for i, t in enumerate(DOCS_NL))
        return f"{d}/in.csv", [], DOCS_NL
    if fmt == "txt":
        with open(f"{d}/in.txt", "w", encoding="utf-8") as fh:
            fh.writelines(t + "\n" for t in DOCS)
        return f"{d}/in.txt", [], DOCS
    if fmt == "txt-doc-per-file":
        os.makedirs(f"{d}/docs")
        for i, t in enumerate(DOCS_NL[:30]):
            with open(f"{d}/docs/{i:03d}.txt", "w", encoding="utf-8") as fh:
                fh.write(t)
        return f"{d}/docs", ["--txt-doc-per-file"], DOCS_NL[:30]
    if fmt in ("dir", "glob"):
        os.makedirs(f"{d}/shards")
        for k in range(3):
            part = DOCS_NL[k * 40 : (k + 1) * 40]
            write_jsonl(f"{d}/shards/part-{k}.jsonl", [{"text": t} for t in part])
        spec = f"{d}/shards" if fmt == "dir" else f"{d}/shards/part-*.jsonl"
        return spec, [], DOCS_NL
    raise AssertionError(fmt)


FORMATS = [
    "jsonl",
    "json-array",
    "json-lines",
    "jsonl.gz",
    "jsonl.zst",
    "parquet",
    "arrow",
    "arrow-stream",
    "csv",
    "txt",
    "txt-doc-per-file",
    "dir",
    "glob",
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_every_format_1_and_2_workers(fmt, tmp_path, capsys, hf_tok, auto_tok):
    src, extra, docs = _write(fmt, str(tmp_path))
    outs = []
    for workers in ("1", "2"):
        prefix = str(tmp_path / f"w{workers}")
        rc, err = run_cli(
            capsys, "preprocess", "--input", src, "--output-prefix", prefix,
            "--tokenizer-name-or-path", hf_tok, "--append-eod", "--workers", workers,
            "--chunk-docs", "7", *extra,
        )  # fmt: skip
        assert rc == 0, err
        assert f"{len(docs)} documents read, {len(docs)} written" in err
        outs.append(prefix + "_text_document")
    assert files_bytes(outs[0]) == files_bytes(outs[1])
    expected = [auto_tok(t)["input_ids"] + [auto_tok.eos_token_id] for t in docs]
    assert read_back(outs[0]) == expected
    assert dataset_dtype(outs[0]) == np.uint16


def test_idx_header_layout(tmp_path, capsys, hf_tok):
    src = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": t} for t in DOCS[:10]])
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix",
                      str(tmp_path / "o"), "--tokenizer-name-or-path", hf_tok)  # fmt: skip
    assert rc == 0, err
    raw = open(tmp_path / "o_text_document.idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 10, 11)  # uint16 = 8; 10 docs + leading 0
    lengths = np.frombuffer(raw, np.int32, 10, 34)
    pointers = np.frombuffer(raw, np.int64, 10, 34 + 40)
    docs = np.frombuffer(raw, np.int64, 11, 34 + 120)
    assert pointers.tolist() == (np.cumsum(lengths) * 2 - lengths * 2).tolist()
    assert docs.tolist() == list(range(11))
    assert len(raw) == 34 + 40 + 80 + 88
    assert os.path.getsize(tmp_path / "o_text_document.bin") == int(lengths.sum()) * 2


def test_gpt_dataset_reads_output(tmp_path, capsys, hf_tok):
    """Megatron's GPTDataset builds samples straight from the written prefix."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    src = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": t} for t in DOCS])
    prefix = str(tmp_path / "o")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-name-or-path", hf_tok, "--append-eod")  # fmt: skip
    assert rc == 0, err

    class _Tok:
        eod = 0
        pad = 1
        vocab_size = 600
        unique_identifiers = {"class": "TinyTok"}

    cfg = GPTDatasetConfig(
        random_seed=1, sequence_length=32, blend=([prefix + "_text_document"], None),
        split="1,0,0", path_to_cache=str(tmp_path / "cache"), tokenizer=_Tok(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    )  # fmt: skip
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [4, None, None], lambda: True, cfg
    ).build()
    sample = train[0]
    assert sample["tokens"].shape[0] == 32 and len(train) >= 4


def test_partitions_merge_equals_single_run(tmp_path, capsys, hf_tok):
    src, _, _ = _write("dir", str(tmp_path))
    a, b = str(tmp_path / "single"), str(tmp_path / "parts")
    base = ["preprocess", "--input", src, "--tokenizer-name-or-path", hf_tok, "--append-eod"]
    assert run_cli(capsys, *base, "--output-prefix", a)[0] == 0
    rc, err = run_cli(capsys, *base, "--output-prefix", b, "--partitions", "3", "--workers", "2")
    assert rc == 0, err
    assert files_bytes(a + "_text_document") == files_bytes(b + "_text_document")
    assert leftovers(str(tmp_path)) == sorted(
        ["shards", *(os.path.basename(p) + s for p in (a, b) for s in
                     ("_text_document.bin", "_text_document.idx"))]
    )  # fmt: skip


def test_multiple_json_keys(tmp_path, capsys, hf_tok, auto_tok):
    recs = [{"title": f"title {i}", "text": t} for i, t in enumerate(DOCS[:20])]
    src = write_jsonl(str(tmp_path / "a.jsonl"), recs)
    prefix = str(tmp_path / "o")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-name-or-path", hf_tok,
                      "--json-keys", "text", "title")  # fmt: skip
    assert rc == 0, err
    for key in ("text", "title"):
        assert read_back(f"{prefix}_{key}_document") == [
            auto_tok(r[key])["input_ids"] for r in recs
        ]


def test_tokenizer_json_file(tmp_path, capsys, hf_tok, auto_tok):
    src = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": t} for t in DOCS])
    prefix = str(tmp_path / "o")
    tok_json = os.path.join(hf_tok, "tokenizer.json")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-name-or-path", tok_json)  # fmt: skip
    assert rc == 0, err
    assert read_back(prefix + "_text_document") == [auto_tok(t)["input_ids"] for t in DOCS]


def test_gpt2_vocab_merges(tmp_path, capsys, hf_tok):
    from tokenizers import Tokenizer
    from transformers import GPT2Tokenizer

    Tokenizer.from_file(os.path.join(hf_tok, "tokenizer.json")).model.save(str(tmp_path))
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    ref = GPT2Tokenizer(vocab, merges)
    src = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": t} for t in DOCS])
    prefix = str(tmp_path / "o")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                      "--merge-file", merges, "--append-eod", "--workers", "2")  # fmt: skip
    assert rc == 0, err
    eod = ref.convert_tokens_to_ids("<|endoftext|>")
    assert read_back(prefix + "_text_document") == [ref.encode(t) + [eod] for t in DOCS]


def test_sentencepiece_model(tmp_path, capsys):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(make_docs(400, 3)), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300,
        model_type="bpe", character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    model = str(tmp_path / "sp.model")
    ref = spm.SentencePieceProcessor(model_file=model)
    src = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": t} for t in DOCS])
    prefix = str(tmp_path / "o")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                      "--append-eod", "--workers", "2")  # fmt: skip
    assert rc == 0, err
    assert read_back(prefix + "_text_document") == [
        ref.encode_as_ids(t) + [ref.eos_id()] for t in DOCS
    ]


def test_trained_tokenizer_is_a_standard_hf_directory(hf_tok, auto_tok):
    assert auto_tok.eos_token == "<|endoftext|>" and auto_tok.pad_token == "<|pad|>"
    assert 260 < len(auto_tok) <= 600  # the small corpus may not fill the whole budget
    text = auto_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    ids = auto_tok(DOCS[3])["input_ids"]
    assert auto_tok.decode(ids) == DOCS[3]


def test_vocab_dtype_rule():
    from anyspeed.data.handlers import vocab_dtype

    assert vocab_dtype(600) == np.uint16 and vocab_dtype(65499) == np.uint16
    assert vocab_dtype(65500) == np.int32 and vocab_dtype(151_936) == np.int32


def test_progress_and_summary_on_stderr(tmp_path, capsys, hf_tok):
    src = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": t} for t in DOCS])
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix",
                      str(tmp_path / "o"), "--tokenizer-name-or-path", hf_tok)  # fmt: skip
    assert rc == 0
    assert "docs" in err and "tok" in err and "MB/s" in err
    assert "120 documents read, 120 written" in err and "o_text_document.bin" in err
