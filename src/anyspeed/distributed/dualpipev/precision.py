"""Megatron's bf16/fp16 wrapper for a V's chunks: precision changes at the model's ends.

``Float16Module`` casts inputs on the first pipeline stage and outputs back to fp32 on the
last, which it finds by pipeline rank. In a V the last stage is rank 0's second chunk, and the
last rank's second chunk is a middle stage whose output must stay in bf16 (its neighbour
receives bf16). Here the wrapped chunk's own ``pre_process`` / ``post_process`` decide.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16


class VFloat16Module(Float16Module):
    """``Float16Module`` whose casts follow the chunk's place in the model, not its rank."""

    def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
        if getattr(self.module, "pre_process", False):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if getattr(self.module, "post_process", False) and fp32_output is True:
            outputs = float16_to_fp32(outputs)
        return outputs
