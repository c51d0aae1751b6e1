"""The benchmarks of ``anyspeed evaluate``: each reads and tokenizes its data before any
process group (``prepare``) and scores the loaded model (``run``) into a result dict."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

from anyspeed.errors import UsageError
from anyspeed.inference.eval import answers as A
from anyspeed.inference.eval import exams as X
from anyspeed.inference.eval import prompts as P
from anyspeed.inference.eval import readers as R

CHOICE_LAYOUTS = {"mmlu": ("mmlu", "test"), "cmmlu": ("cmmlu", "test"), "ceval": ("ceval", "val")}
STOP_CODE = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


@dataclass
class Prepared:
    """Token ids to score plus what each result is checked against."""

    prompts: list[list[int]] = field(default_factory=list)
    answers: list[Any] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # subject of each item
    candidates: list[int] = field(default_factory=list)  # choice tokens (" A".. / " yes")
    extra: list[Any] = field(default_factory=list)  # HumanEval problems


def _wrap(
    args: argparse.Namespace, tok: Any, texts: list[str], chat: bool | None = None
) -> list[list[int]]:
    """Token ids of ``texts``, as a chat user turn unless --no-chat-template (or none), or
    ``chat`` says otherwise."""
    chat = args.use_chat if chat is None else chat
    if chat and getattr(args, "prompt_type", None):  # a built-in template (MindSpeed-LLM's)
        from anyspeed.commands.prompting import template_prompt

        texts = [template_prompt(args.prompt_type, [{"role": "user", "content": t}]) for t in texts]
    elif chat:
        texts = [tok.render_chat([{"role": "user", "content": t}], True) for t in texts]
    return tok.encode(texts, special=not chat)


def _token(tok: Any, text: str) -> int:
    return tok.encode([text], special=False)[0][-1]


def _shots(dev: dict, subject: str, n: int) -> list:
    """The first ``n`` dev questions of ``subject`` (an error when it has none)."""
    shots = dev.get(subject, [])[:n]
    if n and not shots:
        raise UsageError(
            f"--num-fewshot {n}: no dev questions for {subject!r} (add its dev "
            "CSV or pass --num-fewshot 0)"
        )
    return shots


def _prepare_choices(args: argparse.Namespace, tok: Any) -> Prepared:
    layout, split = CHOICE_LAYOUTS[args.task]
    tests = R.read_choices(args.task_data_path, layout, split)
    dev = R.read_choices(args.task_data_path, layout, "dev") if args.num_fewshot else {}
    out, texts = Prepared(), []
    for subject, questions in sorted(tests.items()):
        shots = _shots(dev, subject, args.num_fewshot)
        for q in questions:
            texts.append(P.choice_prompt(q, shots, chinese=args.task != "mmlu"))
            out.answers.append(q.answer)
            out.groups.append(subject)
    space = "" if args.use_chat else " "
    out.candidates = [_token(tok, space + letter) for letter in R.LETTERS]
    return _limit(args, out, texts, tok)


def _limit(
    args: argparse.Namespace,
    out: Prepared,
    texts: list[str],
    tok: Any,
    per_task: bool = False,
    chat: bool | None = None,
) -> Prepared:
    """The first --max-eval-samples items (all when ``per_task``: already cut per task),
    tokenized; a prompt over the context is an error."""
    n = len(texts) if per_task else args.max_eval_samples or len(texts)
    out.answers, out.groups, out.extra = out.answers[:n], out.groups[:n], out.extra[:n]
    out.prompts = _wrap(args, tok, texts[:n], chat)
    for ids in out.prompts:
        if len(ids) >= args.max_length:
            raise UsageError(
                f"a {args.task} prompt is {len(ids)} tokens, over the context of "
                f"{args.max_length} (--max-length; fewer --num-fewshot)"
            )
    return out


def _prepare_likelihood(args: argparse.Namespace, tok: Any) -> Prepared:
    """mmlu_ppl / hellaswag: a context per item and each option as its continuation (plain
    text: likelihoods are read without a chat template); the pick is the option with the
    highest mean log-probability per token."""
    if args.task == "hellaswag":
        rows = R.read_hellaswag(args.task_data_path)
        out = Prepared(answers=[a for _, _, a in rows], groups=["hellaswag"] * len(rows))
        texts, options = [c for c, _, _ in rows], [e for _, e, _ in rows]
    else:
        tests = R.read_choices(args.task_data_path, "mmlu", "test")
        dev = R.read_choices(args.task_data_path, "mmlu", "dev") if args.num_fewshot else {}
        out, texts, options = Prepared(), [], []
        for subject, questions in sorted(tests.items()):
            shots = _shots(dev, subject, args.num_fewshot)
            for q in questions:
                texts.append(P.cloze_prompt(q, shots))
                options.append(q.options)
                out.answers.append(q.answer)
                out.groups.append(subject)
    n = args.max_eval_samples or len(texts)
    out.answers, out.groups = out.answers[:n], out.groups[:n]
    out.prompts = tok.encode(texts[:n], special=True)
    out.extra = [tok.encode([" " + o.strip() for o in opts], special=False) for opts in options[:n]]
    for ctx, conts in zip(out.prompts, out.extra, strict=True):
        if len(ctx) + max(len(c) for c in conts) > args.max_length:
            raise UsageError(
                f"a {args.task} item is {len(ctx) + max(map(len, conts))} tokens, "
                f"over the context of {args.max_length} (--max-length; fewer "
                "--num-fewshot)"
            )
    return out


def _prepare_needle(args: argparse.Namespace, tok: Any) -> Prepared:
    """NeedleBench single-needle retrieval: an item per haystack x length x depth."""
    from anyspeed.inference.eval import needle as N
    from anyspeed.inference.generate import decode

    needles, stacks = N.read_needlebench(args.task_data_path)
    top = args.max_length - args.max_new_tokens - 16  # chat-template turns fit too
    lengths = args.needle_lengths or [top * i // 4 for i in range(1, 5)]
    if max(lengths) > top:
        raise UsageError(
            f"--needle-lengths {max(lengths)}: over the {top} tokens the context "
            f"leaves (--max-length {args.max_length} - --max-new-tokens)"
        )

    def encode(text: str) -> list[int]:
        return tok.encode([text], special=False)[0]

    hay = {s.name: encode(s.text[: 8 * max(lengths)] + "\n") for s in stacks}  # ~4 chars/token
    out, texts = Prepared(), []
    for stack, nd, length, depth in N.needle_items(needles, stacks, lengths, args.needle_depths):
        texts.append(
            N.build_prompt(
                hay[stack.name],
                nd,
                length,
                depth,
                lambda t: len(encode(t)),
                lambda ids: decode(tok, ids),
            )
        )
        out.answers.append(nd)
        out.groups.append(f"{stack.name} {length} tokens")
        out.extra.append(depth)
    return _limit(args, out, texts, tok)


def _run_likelihood(
    args: argparse.Namespace, prep: Prepared, model: list, tok: Any
) -> dict[str, Any]:
    from anyspeed.inference.eval.scoring import continuation_logprobs

    pairs = [(ctx, c) for ctx, conts in zip(prep.prompts, prep.extra, strict=True) for c in conts]
    scores = continuation_logprobs(
        model, pairs, args.evaluation_batch_size, tok.pad_id or 0, tok.vocab_size
    )
    picks, i = [], 0
    for conts in prep.extra:
        mean = [total / max(count, 1) for total, count in scores[i : i + len(conts)]]
        picks.append(max(range(len(mean)), key=mean.__getitem__))
        i += len(conts)
    hits = [p == a for p, a in zip(picks, prep.answers, strict=True)]
    return dict(accuracy_table(prep.groups, hits), picks=picks)


def _prepare_boolq(args: argparse.Namespace, tok: Any) -> Prepared:
    rows = R.read_boolq(args.task_data_path)
    out = Prepared(answers=[0 if a else 1 for _, _, a in rows], groups=["boolq"] * len(rows))
    space = "" if args.use_chat else " "
    out.candidates = [_token(tok, space + "yes"), _token(tok, space + "no")]
    return _limit(args, out, [P.boolq_prompt(p, q) for p, q, _ in rows], tok)


def _prepare_gsm8k(args: argparse.Namespace, tok: Any) -> Prepared:
    rows = R.read_gsm8k(args.task_data_path)
    shots = rows[: args.num_fewshot]
    rows = rows[args.num_fewshot :]  # the shots are not scored
    out = Prepared(answers=[A.normalize_number(a) for _, a in rows], groups=["gsm8k"] * len(rows))
    return _limit(args, out, [P.gsm8k_prompt(q, shots) for q, _ in rows], tok)


def _prepare_humaneval(args: argparse.Namespace, tok: Any) -> Prepared:
    problems = R.read_humaneval(args.task_data_path)
    out = Prepared(
        answers=[None] * len(problems), groups=["human_eval"] * len(problems), extra=problems
    )
    # code continues the prompt verbatim: never a chat turn
    return _limit(args, out, [p["prompt"] for p in problems], tok, chat=False)


def _prepare_ppl(args: argparse.Namespace, tok: Any) -> Prepared:
    import os

    path = args.task_data_path
    if os.path.isfile(path + ".idx") and os.path.isfile(path + ".bin"):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        from anyspeed.data.writer import IndexFileError, check_dataset

        try:
            check_dataset(path)  # the .idx validated and the .bin exactly its size
        except IndexFileError as exc:
            raise R.TaskDataError(f"--task-data-path {path!r}: {exc}") from None
        ds = IndexedDataset(path)
        docs = [ds[i].tolist() for i in range(len(ds))]
    else:
        recs = R.read_jsonl(path)
        if any("text" not in r for r in recs):
            raise R.TaskDataError(f'{path}: a record lacks "text"')
        docs = tok.encode([r["text"] for r in recs], special=True)
    window = args.max_length
    seqs = [d[i : i + window] for d in docs for i in range(0, len(d), window)]
    seqs = [s for s in seqs if len(s) > 1][: args.max_eval_samples or None]
    if not seqs:
        raise R.TaskDataError(f"--task-data-path {path!r}: no text of two or more tokens")
    return Prepared(prompts=seqs, groups=["ppl"] * len(seqs))


def _prepare_exams(args: argparse.Namespace, tok: Any) -> Prepared:
    """BBH / AGIEval: per task, ``--num-fewshot`` solved examples from the head of its file
    (not scored; BBH with --chain-of-thought uses the task's CoT prompt instead)."""
    bbh = args.task == "bbh"
    tasks = (X.read_bbh if bbh else X.read_agieval)(args.task_data_path)
    cot = X.bbh_cot_prompts(args.task_data_path) if bbh and args.chain_of_thought else None
    out, texts = Prepared(), []
    for task, items in sorted(tasks.items()):
        if cot is not None and task not in cot:
            raise UsageError(f"--chain-of-thought: no cot-prompts/{task}.txt")
        shots = [] if cot is not None else items[: args.num_fewshot]
        scored = items[len(shots) :][: args.max_eval_samples or None]  # per task
        for item in scored:
            if bbh:
                texts.append(X.bbh_prompt(item, shots, None if cot is None else cot[task]))
            else:
                texts.append(X.agieval_prompt(item, shots))
            out.answers.append(item)
            out.groups.append(task)
    if not texts:
        raise UsageError(
            f"--task {args.task}: no question left to score after --num-fewshot {args.num_fewshot}"
        )
    return _limit(args, out, texts, tok, per_task=True)


PREPARE = {
    "mmlu": _prepare_choices,
    "cmmlu": _prepare_choices,
    "ceval": _prepare_choices,
    "boolq": _prepare_boolq,
    "gsm8k": _prepare_gsm8k,
    "human_eval": _prepare_humaneval,
    "ppl": _prepare_ppl,
    "bbh": _prepare_exams,
    "agieval": _prepare_exams,
    "mmlu_ppl": _prepare_likelihood,
    "hellaswag": _prepare_likelihood,
    "needlebench": _prepare_needle,
}
FEWSHOT = {
    "mmlu": 5,
    "cmmlu": 5,
    "ceval": 5,
    "bbh": 3,
    "mmlu_ppl": 5,
}  # default --num-fewshot (else 0)
NEW_TOKENS = {"bbh": 32, "agieval": 32, "needlebench": 64}  # default --max-new-tokens (or 256)
# Where a generated answer is over: the next few-shot question, or the next top-level code
STOPS = {
    "gsm8k": ("\n\nQuestion:",),
    "bbh": ("\n\nQ:",),
    "agieval": ("\n\n",),
    "needlebench": ("\n\n",),
    "human_eval": STOP_CODE,
}


def accuracy_table(groups: list[str], correct: list[bool]) -> dict[str, Any]:
    """Accuracy per group and over all items."""
    per: dict[str, list[int]] = {}
    for g, ok in zip(groups, correct, strict=True):
        per.setdefault(g, [0, 0])
        per[g][0] += int(ok)
        per[g][1] += 1
    total = sum(c for c, _ in per.values()), sum(n for _, n in per.values())
    return {
        "accuracy": total[0] / max(total[1], 1),
        "correct": total[0],
        "total": total[1],
        "groups": {
            g: {"accuracy": c / n, "correct": c, "total": n} for g, (c, n) in sorted(per.items())
        },
    }


def run(args: argparse.Namespace, prep: Prepared, model: list, tok: Any) -> dict[str, Any]:
    """Score ``model`` on the prepared task."""
    bs = args.evaluation_batch_size
    if args.task == "ppl":
        from anyspeed.inference.eval.scoring import sequence_nll

        nll, count = sequence_nll(model, prep.prompts, bs, tok.pad_id or 0)
        return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "tokens": count}
    if args.task in ("mmlu_ppl", "hellaswag"):
        return _run_likelihood(args, prep, model, tok)
    if prep.candidates:
        from anyspeed.inference.eval.scoring import model_next_logits, pick_choices

        picks = pick_choices(
            model_next_logits(model, tok.pad_id or 0), prep.prompts, prep.candidates, bs
        )
        hits = [p == a for p, a in zip(picks, prep.answers, strict=True)]
        res = accuracy_table(prep.groups, hits)
        return dict(res, picks=picks)
    return _run_generation(args, prep, model, tok)


def _run_generation(
    args: argparse.Namespace, prep: Prepared, model: list, tok: Any
) -> dict[str, Any]:
    from anyspeed.commands.prompting import end_ids, text_of
    from anyspeed.inference.decode import Request, generate
    from anyspeed.inference.generate import decode

    eos = end_ids(tok)
    req = Request(
        args.max_new_tokens,
        eos_ids=eos,
        pad_id=tok.pad_id or 0,
        max_length=args.max_length,
        vocab_size=tok.vocab_size,
        stop=STOPS[args.task],
        detokenize=lambda ids: decode(tok, ids),
    )
    texts = []
    for start in range(0, len(prep.prompts), args.evaluation_batch_size):
        chunk = prep.prompts[start : start + args.evaluation_batch_size]
        texts += [text_of(tok, ids, eos) for ids in generate(model, chunk, req)]
    if args.task == "gsm8k":
        got = [A.extract_number(t) for t in texts]
        hits = [g == a for g, a in zip(got, prep.answers, strict=True)]
        return dict(accuracy_table(prep.groups, hits), predictions=got)
    if args.task in ("bbh", "agieval", "needlebench"):
        from anyspeed.inference.eval.needle import found

        checks: dict[str, Any] = {
            "bbh": lambda t, e: X.bbh_correct(t, e.target),
            "agieval": X.agieval_correct,
            "needlebench": found,
        }
        hits = [checks[args.task](t, e) for t, e in zip(texts, prep.answers, strict=True)]
        res = dict(accuracy_table(prep.groups, hits), predictions=texts)
        return dict(res, depths=prep.extra) if args.task == "needlebench" else res
    from anyspeed.inference.eval.execution import check_completions

    completions = [truncate_code(t) for t in texts]
    outcomes = check_completions(prep.extra, completions, timeout=args.execution_timeout)
    res = accuracy_table(prep.groups, [o.passed for o in outcomes])
    return dict(
        res,
        pass_at_1=res["accuracy"],
        failures={o.task_id: o.reason for o in outcomes if not o.passed},
    )


def truncate_code(text: str) -> str:
    """A completion cut at the first top-level statement after the function body."""
    cut = min((i for i in (text.find(s) for s in STOP_CODE) if i >= 0), default=len(text))
    return text[:cut]
