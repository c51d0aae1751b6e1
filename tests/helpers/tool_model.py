"""A tiny model that calls tools, for the multi-turn rollout tests: the tiny Qwen2 trained (plain
PyTorch, on the transformers model) until it repeats three conversations that need 1, 2 and 3
calls of ``multiply``, rendered by a tokenizer's chat template; the tokenizer copied with
``<|im_end|>`` as its end token and, optionally, another chat template (TRL's Qwen2.5 one)."""

from __future__ import annotations

import json
import os

import torch

from helpers.user_tools import multiply

QUESTIONS = ["Multiply 2 by 3 by 7 by 2.", "What is 2 times 3 times 7 times 2?",
             "Compute 2 * 3 * 7 * 2 with the tool."]  # fmt: skip
FACTORS = (2, 3, 7, 2)  # three calls: multiply(2, 3), multiply(6, 7), multiply(42, 2)


def tool_schema() -> dict:
    from anyspeed.stages.common.rl.tools import schema

    return schema(multiply)


def conversation(question: str, factors: tuple = FACTORS) -> list[dict]:
    """The question, one ``multiply`` call per factor after the first (each on the last
    answer: the model copies from the tool turn just before), each answered, then the
    product."""
    msgs: list[dict] = [{"role": "user", "content": question}]
    acc = factors[0]
    for x in factors[1:]:
        call = {"type": "function", "function": {"name": "multiply",
                                                  "arguments": {"a": acc, "b": x}}}  # fmt: skip
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        acc = multiply(acc, x)
        msgs.append({"role": "tool", "name": "multiply", "content": str(acc)})
    msgs.append({"role": "assistant", "content": f"The product is {acc}."})
    return msgs


def tokenizer(out: str, chat_template: str | None = None) -> str:
    """A BPE (vocab 600, ``train-tokenizer``) learnt from these conversations with other
    numbers, rendered by ``chat_template`` (default: anyspeed's), saved to ``out`` with
    ``<|im_end|>`` as EOS (an instruct model's): the conversations take ~100 tokens, not 700."""
    import random

    from jinja2 import Template
    from transformers import AutoTokenizer

    from anyspeed.data.train_tokenizer import CHAT_TEMPLATE, train_tokenizer

    template = chat_template or CHAT_TEMPLATE
    rng = random.Random(0)
    texts = []
    for _ in range(300):
        nums = tuple(rng.randrange(2, 999) for _ in range(rng.randrange(2, 5)))
        msgs = conversation(rng.choice(QUESTIONS), nums)
        texts.append(Template(template).render(messages=msgs, tools=[tool_schema()],
                                               add_generation_prompt=False))  # fmt: skip
    corpus = os.path.join(out, "corpus.jsonl")
    os.makedirs(out, exist_ok=True)
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    path = train_tokenizer([corpus], os.path.join(out, "tok"), vocab_size=600, overwrite=True)
    # Edited in place: a save_pretrained round trip re-serializes the BPE (transformers 5 then
    # splits digits differently), and the model must read the tokens it was trained on.
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["eos_token"] = "<|im_end|>"
    cfg.pop("chat_template", None)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    return path


def train(tok_dir: str, out: str, vocab: int = 768, steps: int = 3000, layers: int = 2) -> str:
    """A tiny Qwen2 (2 layers, hidden 128, context 512) trained on the assistant turns of every
    conversation until it repeats them; saved as a Hugging Face directory."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = [pieces(tok, conversation(q)) for q in QUESTIONS]
    data = [(torch.tensor([[t for p, _ in ps for t in p]]),
             torch.tensor([[t if m else -100 for p, m in ps for t in p]]))
            for ps in rows]  # fmt: skip
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      rope_theta=10000.0, eos_token_id=tok.eos_token_id)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in data)
        if loss.item() < 1e-3:  # the weights that gave it: no step after the check
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)  # the tokenizer stays apart: from a directory with a Qwen2
    return out  # config.json, transformers builds Qwen2's tokenizer, which splits digits


def token_row(tok, msgs: list[dict], tools: bool = True) -> list[int]:
    """A conversation's tokens as a rollout builds them: each piece (the prompt, an assistant
    turn up to its end token, the template's text up to the next assistant turn) encoded on
    its own and concatenated, so no token spans two pieces."""
    return [t for piece, _ in pieces(tok, msgs, tools) for t in piece]


def pieces(tok, msgs: list[dict], tools: bool = True) -> list[tuple[list[int], bool]]:
    """The pieces of :func:`token_row`, each with whether the model writes it (an assistant
    turn) or not (the prompt, a tool turn)."""

    def render(m: list[dict], gen: bool) -> str:
        return tok.apply_chat_template(m, tools=[tool_schema()] if tools else None,
                                       tokenize=False, add_generation_prompt=gen)  # fmt: skip

    ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    out, done = [], ""
    for i in ends:
        prompt = render(msgs[:i], True)
        turn = render(msgs[: i + 1], False)[len(prompt) :]
        turn = turn[: turn.index(tok.eos_token) + len(tok.eos_token)]
        out += [(prompt[len(done) :], False), (turn, True)]
        done = prompt + turn
    return [(tok(p, add_special_tokens=False)["input_ids"], model) for p, model in out]


def prompt_records() -> list[dict]:
    """The questions as RL prompt records with their tools (TRL's layout)."""
    from functools import reduce

    answer = str(reduce(multiply, FACTORS))
    return [{"instruction": q, "output": answer, "tools": json.dumps([tool_schema()])}
            for q in QUESTIONS]  # fmt: skip
