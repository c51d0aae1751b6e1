"""``--prompt-type`` templates against the families' own Hugging Face ``chat_template``s.

Each reference template below is the published ``chat_template`` of the family's instruct
tokenizer (tokenizer_config.json of Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen3-8B,
meta-llama/Meta-Llama-3-8B-Instruct, mistralai/Mistral-7B-Instruct-v0.2), reduced to the
branches plain chats use (no tools, no reasoning_content); the BOS token is written out. The
test tokenizer is the session's trained BPE with that template set, so no download happens.
Prompt and response token ids from ``anyspeed preprocess --prompt-type X`` must equal the ones
transformers' ``apply_chat_template`` gives for the same conversation."""

from __future__ import annotations

import pytest

from helpers.corpora import make_docs, read_back, write_jsonl
from helpers.instruction import preprocess

QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = '<|begin_of_text|>' + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ '<s>' }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + '</s>' }}{% endif %}"
    "{% endfor %}"
)
CASES = {  # prompt type: (HF template, apply_chat_template kwargs, turns)
    "qwen2.5": (QWEN25, {}, 2),
    "qwen3": (QWEN3, {"enable_thinking": True}, 1),
    "qwen3-nothink": (QWEN3, {"enable_thinking": False}, 1),
    "llama3": (LLAMA3, {}, 2),
    "mistral": (MISTRAL, {}, 2),
}
WORDS = make_docs(40, seed=21)


def reference(tok, messages: list[dict], kwargs: dict) -> tuple[list[int], list[int]]:
    """input_ids/labels from the HF template: each assistant turn is a response."""
    ids, labels, done = [], [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(
            messages[:i], tokenize=False, add_generation_prompt=True, **kwargs
        )
        full = tok.apply_chat_template(messages[: i + 1], tokenize=False, **kwargs)
        p = tok(prompt[len(done) :], add_special_tokens=False)["input_ids"]
        r = tok(full[len(prompt) :], add_special_tokens=False)["input_ids"]
        ids, labels, done = ids + p + r, labels + [-100] * len(p) + r, full
    return ids, labels


@pytest.mark.parametrize("prompt_type", list(CASES))
def test_prompt_type_matches_the_hf_chat_template(prompt_type, hf_tok, tmp_path):
    from transformers import AutoTokenizer

    template, kwargs, turns = CASES[prompt_type]
    tok = AutoTokenizer.from_pretrained(hf_tok)
    tok.chat_template = template
    recs = []
    for k in range(4):
        conv = [
            {"from": "human" if j % 2 == 0 else "gpt", "value": WORDS[k * 4 + j]}
            for j in range(2 * turns)
        ]
        sys = "be brief" if k % 2 and prompt_type != "mistral" else None
        recs.append({"conversations": conv, "system": sys})
    src = write_jsonl(str(tmp_path / "c.jsonl"), recs)
    prefix = preprocess(
        src,
        str(tmp_path / "t"),
        hf_tok,
        "--prompt-type",
        prompt_type,
        handler="SharegptStyleInstructionHandler",
    )
    ids = read_back(f"{prefix}_packed_input_ids_document")
    labels = read_back(f"{prefix}_packed_labels_document")
    for rec, i, lab in zip(recs, ids, labels, strict=True):
        msgs = [{"role": "system", "content": rec["system"]}] if rec["system"] else []
        msgs += [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in rec["conversations"]
        ]
        assert (i, lab) == reference(tok, msgs, kwargs)
