"""``anyspeed evaluate``: a checkpoint (any saved layout) or HF directory on a benchmark.

``--task mmlu|cmmlu|ceval|boolq`` scores the answer by the next-token logits of the choice
letters (or " yes" / " no"), ``gsm8k`` generates and extracts the final number, ``human_eval``
generates completions and runs them in a sandbox with a timeout, only with
``--allow-code-execution`` (the problems come from the ``human-eval`` package unless
``--task-data-path`` is given), ``ppl`` is perplexity of
a jsonl ``text`` file or a ``.bin/.idx`` prefix, ``bbh`` and ``agieval`` generate and check the
extracted answer, ``mmlu_ppl`` and ``hellaswag`` pick the option whose text is most likely,
``needlebench`` asks for a fact hidden in a long haystack (single-needle retrieval).
The result prints as a table; ``--output-json`` writes it as JSON. MindSpeed-LLM's flags:
``--task-data-path``, ``--max-eval-samples``, ``--evaluation-batch-size``,
``--no-chat-template``, and ``--num-fewshot`` for the shots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from anyspeed.commands import eval_tasks, runner, session
from anyspeed.distributed.process import is_rank0, print0
from anyspeed.errors import OneLineArgumentParser, UsageError

PROG = "anyspeed evaluate"


def build_parser() -> argparse.ArgumentParser:
    from anyspeed.data.templates import TEMPLATES

    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    session.add_model_arguments(p)
    g = p.add_argument_group("evaluation")
    g.add_argument("--task", required=True, choices=sorted(eval_tasks.PREPARE))
    g.add_argument("--task-data-path", default=None)
    g.add_argument("--max-eval-samples", type=int, default=None)
    g.add_argument("--evaluation-batch-size", type=int, default=1)
    g.add_argument(
        "--no-chat-template",
        action="store_true",
        help="plain prompts even when the tokenizer has a chat template",
    )
    g.add_argument(
        "--prompt-type",
        choices=sorted(TEMPLATES),
        default=None,
        help="render prompts with this built-in template, not the tokenizer's chat template",
    )
    g.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="solved examples each (mmlu/cmmlu/ceval 5, bbh 3; else 0)",
    )
    g.add_argument(
        "--chain-of-thought",
        action="store_true",
        help="bbh: prompt with the task's cot-prompts/{task}.txt",
    )
    g.add_argument(
        "--needle-lengths",
        type=_ints,
        default=None,
        metavar="N,N,...",
        help="needlebench: prompt lengths in tokens (default: 4 up to the context)",
    )
    g.add_argument(
        "--needle-depths",
        type=_ints,
        default=(0, 25, 50, 75, 100),
        metavar="P,P,...",
        help="needlebench: needle depths in percent of the text",
    )
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens per answer (bbh/agieval 32, needlebench 64; else 256)",
    )
    g.add_argument(
        "--execution-timeout",
        type=float,
        default=10.0,
        help="seconds each HumanEval program may run",
    )
    g.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="human_eval: run the model-written programs (in a sandbox; also HF_ALLOW_CODE_EVAL=1)",
    )
    g.add_argument("--output-json", default=None, help="also write the result here as JSON")
    return p


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _check_execution(args: argparse.Namespace) -> None:
    """--execution-timeout is positive; human_eval runs model-written code only when asked,
    and says first which sandbox protections this machine lacks."""
    if not 0 < args.execution_timeout < float("inf"):
        raise UsageError(
            f"--execution-timeout {args.execution_timeout:g}: must be a positive number of seconds"
        )
    if args.task != "human_eval":
        return
    if not args.allow_code_execution and os.environ.get("HF_ALLOW_CODE_EVAL") != "1":
        raise UsageError(
            "--task human_eval runs code the model wrote: pass "
            "--allow-code-execution (or set HF_ALLOW_CODE_EVAL=1) to allow it"
        )
    from anyspeed.inference.eval.execution import missing_protections

    for line in missing_protections():
        print0(f"{PROG}: warning: {line}", file=sys.stderr)


def _check_output(path: str | None) -> None:
    """--output-json can be written (checked by opening it, so permissions, a missing
    directory or a read-only filesystem all show) before any work starts."""
    if not path:
        return
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(21, "is a directory")
        if os.path.exists(path):
            open(path, "r+b").close()  # writable, left as it is
        else:
            open(path, "xb").close()
            os.remove(path)
    except OSError as exc:
        raise UsageError(
            f"--output-json {path}: cannot be written ({exc.strerror or exc}); "
            "choose a writable path"
        ) from None


def _complete(args: argparse.Namespace, tok: Any) -> None:
    """Parse time: the task's defaults for the flags not given, and whether prompts go
    through the chat template."""
    if args.max_new_tokens is None:
        args.max_new_tokens = (
            256 if args.chain_of_thought else eval_tasks.NEW_TOKENS.get(args.task, 256)
        )
    if args.num_fewshot is None:
        args.num_fewshot = eval_tasks.FEWSHOT.get(args.task, 0)
    if args.prompt_type and args.no_chat_template:
        raise UsageError("--prompt-type and --no-chat-template exclude each other")
    args.use_chat = bool(args.prompt_type) or (not args.no_chat_template and tok.has_chat_template)


def _check(args: argparse.Namespace, model: Any, tok: Any) -> Any:
    """The flags checked and the task's items opened (the run's ``data``)."""
    if session.is_llava(model):
        raise UsageError(
            f"--load {args.load!r} holds a vision-language model: anyspeed evaluate scores "
            "text models (ask it with anyspeed generate --image)"
        )
    _check_execution(args)
    _check_output(args.output_json)
    if args.task != "human_eval" and not args.task_data_path:
        raise UsageError(f"--task {args.task} needs --task-data-path")
    if args.chain_of_thought and args.task != "bbh":
        raise UsageError("--chain-of-thought is for --task bbh")
    for flag in ("evaluation_batch_size", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be positive")
    if args.max_eval_samples is not None and args.max_eval_samples < 1:
        raise UsageError("--max-eval-samples must be positive")
    if any(not 0 <= d <= 100 for d in args.needle_depths) or not args.needle_depths:
        raise UsageError("--needle-depths must be percentages from 0 to 100")
    if args.needle_lengths is not None and (
        not args.needle_lengths or min(args.needle_lengths) < 1
    ):
        raise UsageError("--needle-lengths must be positive token counts")
    if args.num_fewshot < 0:
        raise UsageError("--num-fewshot must be 0 or more")
    prepared = eval_tasks.PREPARE[args.task](args, tok)
    if not prepared.prompts:
        raise UsageError(
            f"--task {args.task}: no item to score in --task-data-path "
            f"{args.task_data_path} (empty, or all used as --num-fewshot shots)"
        )
    return prepared


def table(task: str, res: dict[str, Any]) -> str:
    """The result as a text table (one row per subject, then the total)."""
    if task == "ppl":
        return (
            f"{'task':<12}{'tokens':>10}{'nll/token':>12}{'perplexity':>14}\n"
            f"{task:<12}{res['tokens']:>10}{res['nll_per_token']:>12.4f}"
            f"{res['perplexity']:>14.3f}"
        )
    width = max([len(g) for g in res["groups"]] + [len(task) + 6, 7]) + 2
    lines = [f"{'subject':<{width}}{'correct':>9}{'total':>7}{'accuracy':>10}"]
    for g, r in res["groups"].items():
        lines.append(f"{g:<{width}}{r['correct']:>9}{r['total']:>7}{r['accuracy']:>10.4f}")
    lines.append(
        f"{task + ' (all)':<{width}}{res['correct']:>9}{res['total']:>7}{res['accuracy']:>10.4f}"
    )
    return "\n".join(lines)


def _body(run: session.InferenceRun, model: list) -> None:
    args = run.args
    res = eval_tasks.run(args, run.data, model, run.tokenizer)
    if res.get("total", res.get("tokens")) == 0:
        raise ValueError(
            f"--task {args.task}: no item was scored (check --task-data-path "
            "and --max-eval-samples)"
        )
    print0(table(args.task, res))
    if args.output_json and is_rank0():
        doc = {"task": args.task, "load": args.load, **res}
        try:
            with open(args.output_json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
        except OSError as exc:  # the results are not lost: they go to stdout first
            print(json.dumps(doc, indent=1), flush=True)
            raise ValueError(
                f"--output-json {args.output_json}: could not write the results "
                f"({exc.strerror or exc}); they are printed above"
            ) from None
        print0(f"{PROG}: wrote {args.output_json}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``anyspeed evaluate``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = runner.Command(PROG, build_parser(), _check, _body, complete=_complete)
    return runner.run(cmd, argv)


if __name__ == "__main__":
    raise SystemExit(main())
