"""Built-in chat templates (``--prompt-type``) that split a conversation into prompt/response."""

from __future__ import annotations

from dataclasses import dataclass

from anyspeed.data.errors import UsageError

Segment = tuple[str, bool, bool]  # (text, is_response, append_eod_after)


@dataclass(frozen=True)
class Template:
    """Plain-text chat layout; ``{content}`` is replaced by each message's text."""

    user: str
    assistant: str
    system: str = "{content}"
    default_system: str = ""
    prefix: str = ""
    eod_after_response: bool = False

    def segments(self, messages: list[dict]) -> list[Segment]:
        """Split a rendered conversation into prompt and response pieces, in order."""
        out: list[Segment] = []
        prompt = self.prefix
        rest = messages
        system = self.default_system
        if rest and rest[0]["role"] == "system":
            system, rest = rest[0]["content"], rest[1:]
        if system:
            prompt += self.system.format(content=system)
        for msg in rest:
            if msg["role"] == "assistant":
                out.append((prompt, False, False))
                out.append(
                    (self.assistant.format(content=msg["content"]), True, self.eod_after_response)
                )
                prompt = ""
            else:
                prompt += self.user.format(content=msg["content"])
        return [s for s in out if s[0] or s[1]]


_CHATML = dict(
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
    assistant="{content}<|im_end|>\n",
)

_QWEN3_THINK = "<think>\n\n</think>\n\n"  # the empty thinking block Qwen3 renders

TEMPLATES: dict[str, Template] = {
    "chatml": Template(**_CHATML),
    "qwen": Template(**_CHATML, default_system="You are a helpful assistant."),
    "qwen2.5": Template(
        **_CHATML,
        default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    ),
    # Qwen3, thinking on (its default): the response starts with the (empty) thinking block.
    "qwen3": Template(**dict(_CHATML, assistant=_QWEN3_THINK + "{content}<|im_end|>\n")),
    # Qwen3 with enable_thinking=False: the block closes the prompt, the response is the text.
    "qwen3-nothink": Template(**dict(_CHATML, user=_CHATML["user"] + _QWEN3_THINK)),
    "mistral": Template(
        prefix="<s>", user="[INST] {content} [/INST]", assistant="{content}</s>", system=""
    ),
    "llama3": Template(
        prefix="<|begin_of_text|>",
        system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        user=(
            "<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        assistant="{content}<|eot_id|>",
    ),
    # Gemma (MindSpeed-LLM's "gemma"): no system role, a system text goes before the first
    # turn as it is; each model turn closes with <end_of_turn>.
    "gemma": Template(
        prefix="<bos>",
        user="<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n",
        assistant="{content}<end_of_turn>\n",
    ),
    "alpaca": Template(
        default_system=(
            "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request."
        ),
        system="{content}\n\n",
        user="### Instruction:\n{content}\n\n### Response:\n",
        assistant="{content}",
        eod_after_response=True,
    ),
    "default": Template(
        system="System: {content}\n",
        user="Human: {content}\nAssistant: ",
        assistant="{content}",
        eod_after_response=True,
    ),
}


def thinking_template(prompt_type: str | None, enable_thinking: str | None) -> str | None:
    """``--prompt-type`` with MindSpeed-LLM's ``--enable-thinking true|false|none`` applied:
    qwen3 only; its reasoning template puts the empty thinking block in the prompt
    (qwen3-nothink) unless it is true. UsageError for another template."""
    if enable_thinking is None:
        return prompt_type
    if prompt_type not in ("qwen3", "qwen3-nothink"):
        raise UsageError(
            f"--enable-thinking applies to --prompt-type qwen3 (got {prompt_type!r}); remove it"
        )
    return "qwen3" if enable_thinking == "true" else "qwen3-nothink"
