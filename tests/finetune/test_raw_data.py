"""MindSpeed-LLM's on-the-fly preprocessing: a raw ``--data-path`` (its recipes pass the alpaca
``.json`` with ``--handler-name``, ``--prompt-type``, ``--enable-thinking``, ``--pack``,
``--workers``) is tokenized at start-up into exactly the files ``anyspeed preprocess`` writes,
kept and reused while its input and settings hold, rebuilt when they change, and never written
over when another run wrote the files. Checked against the preprocess command's own output."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.prepare import prepare
from helpers.corpora import make_docs, write_jsonl
from helpers.instruction import VOCAB, alpaca_records, preprocess

KINDS = ("input_ids", "attention_mask", "labels")


def _argv(data: str, tok: str, *extra: str, stage: str = "sft") -> list[str]:
    flag = ["--is-instruction-dataset"] if stage == "sft" else []
    return ["--stage", stage, "--data-path", data, *flag, "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4",
            "--tokenizer-type", "PretrainedFromHF",
            "--tokenizer-name-or-path", tok, "--padded-vocab-size", str(VOCAB),
            "--max-position-embeddings", "512", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--split", "100,0,0", *extra]  # fmt: skip


def _prepare(argv: list[str], command: str = "posttrain"):
    os.environ.pop("WORLD_SIZE", None)
    return prepare(argv, "launcher", command)


def _digest(prefix: str) -> dict[str, str]:
    """Each file of a dataset prefix's family, by content."""
    folder, name = os.path.split(prefix)
    return {
        f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
        for f in sorted(os.listdir(folder))
        if f.startswith(name + "_") and f.endswith((".bin", ".idx"))
    }


RECIPE = ("--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "qwen3",
          "--enable-thinking", "false", "--pack", "--neat-pack", "--workers", "2",
          "--seq-length", "192")  # fmt: skip


def test_raw_json_equals_the_preprocess_command(hf_tok, tmp_path, capsys):
    """The recipe's flags on a raw alpaca ``.json``: the same files the preprocess command
    writes with the same settings (``--enable-thinking false`` = qwen3-nothink), beside the
    input, and the run (and its ranks) train on that prefix."""
    (tmp_path / "data").mkdir()
    src = str(tmp_path / "data" / "alpaca.json")  # a JSON array, as alpaca_data.json is
    with open(src, "w", encoding="utf-8") as f:
        json.dump(alpaca_records(12), f, ensure_ascii=False)
    ref = preprocess(src, str(tmp_path / "ref" / "alpaca"), hf_tok, "--prompt-type",
                     "qwen3-nothink", "--pack", "--neat-pack", "--seq-length", "192")  # fmt: skip
    run, argv = _prepare(_argv(src, hf_tok, *RECIPE))
    out = str(tmp_path / "data" / "alpaca")
    assert run.args.data_path == [out] and run.args.prompt_type == "qwen3-nothink"
    at = argv.index("--data-path")  # the ranks' command line names the prefix alone
    assert argv.count("--data-path") == 1 and src not in argv and argv[at + 1] == out
    assert at + 2 == len(argv) or argv[at + 2].startswith("--")
    got, want = _digest(out), _digest(ref)
    assert len(got) == 6 and list(got.values()) == list(want.values())
    err = capsys.readouterr().err
    assert f"--data-path {src!r}: preprocessing -> {out}" in err
    assert "12 documents read, 12 written in" in err


def test_kept_while_input_and_settings_hold(hf_tok, tmp_path, capsys):
    src = write_jsonl(str(tmp_path / "a.jsonl"), alpaca_records(8))
    out = str(tmp_path / "a")
    _prepare(_argv(src, hf_tok, *RECIPE))
    first = _digest(out)
    stamp = os.stat(out + "_packed_input_ids_document.bin").st_mtime_ns
    capsys.readouterr()
    _prepare(_argv(src, hf_tok, *RECIPE))  # the same: reused, not rewritten
    assert "reusing its preprocessed" in capsys.readouterr().err
    assert os.stat(out + "_packed_input_ids_document.bin").st_mtime_ns == stamp
    # another --seq-length packs differently: rebuilt, as the command would write it
    _prepare(_argv(src, hf_tok, *RECIPE[:-1], "256"))
    assert "its input or settings changed" in capsys.readouterr().err
    ref = preprocess(src, str(tmp_path / "r256" / "a"), hf_tok, "--prompt-type", "qwen3-nothink",
                     "--pack", "--neat-pack", "--seq-length", "256")  # fmt: skip
    assert list(_digest(out).values()) == list(_digest(ref).values()) != list(first.values())
    # a changed input: rebuilt from the new records
    write_jsonl(src, alpaca_records(8, seed=5))
    _prepare(_argv(src, hf_tok, *RECIPE[:-1], "256"))
    ref = preprocess(src, str(tmp_path / "r5" / "a"), hf_tok, "--prompt-type", "qwen3-nothink",
                     "--pack", "--neat-pack", "--seq-length", "256")  # fmt: skip
    assert list(_digest(out).values()) == list(_digest(ref).values())


def test_files_another_run_wrote_are_kept(hf_tok, tmp_path):
    """Output files without this conversion's manifest are refused (unchanged), and rebuilt
    only with ``--overwrite-cache``."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), alpaca_records(8))
    out = preprocess(src, str(tmp_path / "a"), hf_tok, "--prompt-type", "qwen")
    before = _digest(out)
    with pytest.raises(UsageError, match="files exist and this run did not write them; give "
                       "that prefix as --data-path, or --overwrite-cache"):  # fmt: skip
        _prepare(_argv(src, hf_tok, *RECIPE))
    assert _digest(out) == before
    _prepare(_argv(src, hf_tok, *RECIPE, "--overwrite-cache"))
    assert _digest(out) != before and os.path.isfile(out + ".preprocess.json")


def test_pretraining_text_from_a_raw_file(hf_tok, tmp_path):
    """``anyspeed pretrain --data-path 1 corpus.jsonl``: MindSpeed-LLM's
    ``corpus_text_document``, as the command writes it; the blend's weight kept."""
    src = write_jsonl(str(tmp_path / "c4.jsonl"), [{"text": d} for d in make_docs(60)])
    ref = preprocess(src, str(tmp_path / "ref" / "c4"), hf_tok, "--append-eod",
                     "--prompt-type", "hf", handler="GeneralPretrainHandler")  # fmt: skip
    argv = _argv(src, hf_tok, "--append-eod", "--seq-length", "64", stage="pretrain")[4:]
    run, _ = _prepare(["--data-path", "1", src, *argv], "pretrain")
    out = str(tmp_path / "c4_text_document")
    assert run.args.data_path == ["1", out]
    assert list(_digest(str(tmp_path / "c4")).values()) == list(_digest(ref).values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ((), "is a raw dataset: name its --handler-name (AlpacaStyleInstructionHandler"),
        (("--handler-name", "AlpacaStylePairwiseHandler"),
         "--handler-name AlpacaStylePairwiseHandler (not for this stage): --stage sft trains on "
         "instruction data"),
        (("--handler-name", "Nope"), "--handler-name Nope (unknown)"),
        (("--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "qwen",
          "--enable-thinking", "true"), "--enable-thinking applies to --prompt-type qwen3"),
        (("--handler-name", "AlpacaStyleInstructionHandler", "--workers", "0"),
         "--workers must be"),
        (("--handler-name", "AlpacaStyleInstructionHandler", "--neat-pack"),
         "--neat-pack needs --pack"),
    ],
)  # fmt: skip
def test_bad_requests_are_one_line_before_any_output(hf_tok, tmp_path, extra, message):
    src = write_jsonl(str(tmp_path / "a.jsonl"), alpaca_records(4))
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _prepare(_argv(src, hf_tok, "--seq-length", "128", *extra))
    assert sorted(os.listdir(tmp_path)) in (["a.jsonl"], ["a.jsonl", "a.preprocess.lock"])


def test_prefix_data_notes_the_unused_flags(sft_data, capsys):
    _prepare(_argv(sft_data["padded"], sft_data["tok"], "--seq-length", "128", "--workers", "4",
                   "--handler-name", "AlpacaStyleInstructionHandler"))  # fmt: skip
    assert "note: --workers apply to a raw --data-path" in capsys.readouterr().err


_RANK = """
import os, sys, time
from argparse import Namespace
from anyspeed.stages.common import raw_data
import anyspeed.data.pipeline, anyspeed.data.runner
src, tok = sys.argv[1:]
args = Namespace(data_path=[src], enable_thinking="false", prompt_type="qwen3",
                 handler_name="AlpacaStyleInstructionHandler", json_keys=None, map_keys=None,
                 append_eod=False, pack=True, neat_pack=True, workers=2, n_subs=None,
                 output_prefix=None, overwrite_cache=False, tokenizer_name_or_path=tok,
                 seq_length=192, placeholder_token=None, reward_tokens=None)
open(f"ready{os.environ['RANK']}", "w").close()
while not os.path.exists("go"):  # both ranks reach the conversion at once
    time.sleep(0.005)
raw_data.resolve(args, "sft", "posttrain")  # what prepare runs in each torchrun rank
print(args.data_path[0])
"""


def test_ranks_started_by_torchrun_convert_once(hf_tok, tmp_path):
    """Two ranks of one torchrun start at once: one converts under the lock, the other
    reuses its output; both train on the same prefix."""
    src = write_jsonl(str(tmp_path / "a.jsonl"), alpaca_records(64))
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, src, hf_tok], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         env={**os.environ, "WORLD_SIZE": "2", "RANK": str(r)})
        for r in range(2)
    ]  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert {o.strip() for o, _ in outs} == {str(tmp_path / "a")}
    assert sum("preprocessing ->" in e for _, e in outs) == 1, outs


def test_stages_that_read_raw_json_keep_it(tmp_path):
    """The VLM stages read their conversation .jsonl as it is: no conversion, and a
    --handler-name there is one line."""
    from argparse import Namespace

    from anyspeed.stages.common import raw_data

    src = write_jsonl(str(tmp_path / "train.jsonl"), [{"text": "a"}])
    args = Namespace(data_path=[src], enable_thinking=None, handler_name=None)
    raw_data.resolve(args, "vlm", "posttrain")
    assert args.data_path == [src] and os.listdir(tmp_path) == ["train.jsonl"]
    with pytest.raises(UsageError, match="--stage vlm reads its --data-path as it is"):
        raw_data.resolve(Namespace(**{**vars(args), "handler_name": "X"}), "vlm", "posttrain")
