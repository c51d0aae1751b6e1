"""TRL's multi-turn GRPO rollout, the reference of the tool-calling tests: ``GRPOTrainer(tools=
[...])``'s own generation and tool loop (greedy: top-k 1) on the same model and tokenizer."""

from __future__ import annotations

import warnings


def trl_rollout(model: str, tok_dir: str, questions: list[str], calls: int, max_new: int,
                out_dir: str) -> dict:  # fmt: skip
    """Each question's prompt ids, completion ids (tool turns included) and tool mask."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from helpers.user_tools import multiply

    tok = AutoTokenizer.from_pretrained(tok_dir)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    prompts = [[{"role": "user", "content": q}] for q in questions]
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=len(questions),
                      num_generations=len(questions), max_completion_length=max_new,
                      top_k=1, temperature=1.0, use_cpu=True, report_to="none",
                      max_tool_calling_iterations=calls, bf16=False, logging_steps=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=net, reward_funcs=lambda completions, **kw: [0.0] * len(
            completions), args=args, train_dataset=Dataset.from_list([{"prompt": p}
            for p in prompts]), processing_class=tok, tools=[multiply])  # fmt: skip
        # what GRPOTrainer sets per batch before it generates (_generate_and_score_completions)
        trainer._sync_tool_dicts = [{"multiply": multiply} for _ in prompts]
        trainer._async_tool_dicts = [{} for _ in prompts]
        prompt_ids, completion_ids, tool_mask, *_ = trainer._generate(prompts)
    return {"prompt_ids": [list(map(int, p)) for p in prompt_ids],
            "completion_ids": [list(map(int, c)) for c in completion_ids],
            "tool_mask": [list(map(int, m)) for m in tool_mask]}  # fmt: skip
