"""The stage table, the typed run and named metrics on the log line, in-process: a stage is
looked up by name (an unknown one lists the known ones), the parsed flags are read-only once
checked, and a task's metrics reach the iteration line, the metrics file and TensorBoard under
their own names (the pretraining line keeps Megatron-LM's ``lm loss``)."""

from __future__ import annotations

import argparse
import json

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.prepare import prepare
from anyspeed.stages.table import POSTTRAIN_STAGES, STAGES, get_stage
from anyspeed.training import hooks as H
from anyspeed.training.run import ParsedArgsWrite

MOCK = ("--model tiny-qwen2.5 --mock-data --vocab-size 512 --seq-length 32 --train-iters 2 "
        "--lr 1e-3 --global-batch-size 4 --micro-batch-size 2").split()  # fmt: skip


def test_every_posttrain_stage_is_a_row():
    assert set(POSTTRAIN_STAGES) <= set(STAGES)
    for name in POSTTRAIN_STAGES:
        row = get_stage(name)
        assert row.name == name and row.command == "posttrain"


def test_unknown_stage_lists_the_known_ones(capsys):
    from anyspeed.commands.train import posttrain

    assert posttrain([*MOCK, "--stage", "kto"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--stage 'kto' is unknown; choose one of sft" in err and "ppo" in err


def test_posttrain_help_lists_the_stages(capsys):
    from anyspeed.commands.train import posttrain

    assert posttrain(["--help"]) == 0
    assert "stages: sft" in capsys.readouterr().out


def test_the_parsed_flags_are_read_only(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    run, _ = prepare(list(MOCK))
    assert run.stage == "pretrain" and run.model.vocab_size == 512 and run.load is None
    with pytest.raises(ParsedArgsWrite, match="args.lr"):
        run.args.lr = 1.0
    run.args.lr = run.args.lr  # re-applying a value it has is no change
    with pytest.raises(AttributeError):
        run.load = "elsewhere"  # the run itself is frozen too


def test_pretrain_refuses_posttrain_flags(capsys):
    from anyspeed.commands.train import pretrain

    assert pretrain([*MOCK, "--lora-r", "8"]) == 2
    assert "unsupported flag --lora-r" in capsys.readouterr().err


class _Opt:
    def get_loss_scale(self):
        return 1.0


def test_metrics_reach_the_line_the_file_and_tensorboard(tmp_path, capsys):
    args = argparse.Namespace(train_iters=2, no_progress_bar=True, tensorboard_dir=None,
                              metrics_file=str(tmp_path / "m.jsonl"), log_interval=1,
                              global_batch_size=4, seq_length=8, fp16=False)  # fmt: skip
    run = argparse.Namespace(args=args, prog="anyspeed posttrain")
    rep = H.Reporter(args, 0)
    seen = {}
    rep.tb.scalars = lambda values, it: seen.update(values)
    hook = H.LogHook(rep, run, 1.0, 1e30, label="dpo loss")
    state = argparse.Namespace(iteration=1, train_iters=2, consumed=4,
                               trainer=argparse.Namespace(optimizer=_Opt()),
                               history={"skipped": []})  # fmt: skip
    out = {"loss": 0.5, "grad_norm": 1.0, "lr": 1e-3,
           "metrics": {"rewards/accuracies": 0.75, "kl": 0.125}}  # fmt: skip
    hook.after_step(state, out)
    rep.close()
    line = capsys.readouterr().out
    assert "dpo loss: 5.000000E-01 |" in line and "lm loss" not in line
    assert "rewards/accuracies: 7.500000E-01 |" in line and "kl: 1.250000E-01 |" in line
    record = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert record["dpo_loss"] == 0.5 and record["rewards/accuracies"] == 0.75
    assert seen["dpo-loss"] == 0.5 and seen["kl"] == 0.125


def test_stage_rows_build_their_tasks():
    """Each row's task type and flags: a new stage is a row plus its task module."""
    sft = get_stage("sft")
    p = argparse.ArgumentParser()
    for add in sft.flags:
        add(p)
    flags = {f for a in p._actions for f in a.option_strings}
    assert {"--stage", "--lora-r", "--is-instruction-dataset"} <= flags
    with pytest.raises(UsageError, match="--stage is required"):
        get_stage(None)
