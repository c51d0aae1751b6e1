"""Generation through Megatron's ``GatedDeltaNet`` with its recurrent state (Qwen3-Next).

Megatron-Core 0.16.1's DeltaNet refuses an inference context. A DeltaNet needs no KV cache:
each layer carries the last ``kernel - 1`` inputs of its causal convolution and the delta
rule's state ([value heads, key dim, value dim] per row), so a decode step costs the same
whatever the length. Both live on the ``StaticInferenceContext`` next to the attention layers'
keys and values, keyed by layer number; the prompt (prefill) runs the chunked rule, each later
token the recurrent one. Left padding is zeroed at the layer's input (with or without the
cache), as transformers does, so pad slots leave the convolution and the state untouched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

STATES = "_anyspeed_delta_states"  # attribute of the inference context: {layer: (conv, rule)}


def states_of(context: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The DeltaNet states held by ``context`` (created empty on first use)."""
    if not hasattr(context, STATES):
        setattr(context, STATES, {})
    return getattr(context, STATES)


def reorder_states(context: Any, rows: torch.Tensor) -> None:
    """Keep rows ``rows`` of every DeltaNet state (beam search), as the KV cache does."""
    held = states_of(context)
    for layer, (conv, rule) in held.items():
        held[layer] = (conv[rows.to(conv.device)], rule[rows.to(rule.device)])


def zero_padding(hidden_states: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    """[s, b, h] with left-padding slots zeroed. A padding slot is one every later query hides,
    in the run of such slots that starts the row (a causal mask has none; a one-token step
    none); zero inputs leave the convolution and the delta rule's state as they were."""
    s = hidden_states.shape[0]
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or s == 1:
        return hidden_states
    m = attention_mask[:, 0, -s:, -s:].bool()  # [b, query, key], True: hidden
    later = torch.ones(s, s, dtype=torch.bool, device=m.device).tril(-1)  # query after key
    hidden = (m | ~later).all(dim=1)
    hidden[:, -1] = False
    pad = hidden.int().cumprod(dim=1).bool()
    if not pad.any():
        return hidden_states
    return hidden_states.masked_fill(pad.t()[..., None].to(hidden_states.device), 0.0)


def _convolve(self: Any, qkv: torch.Tensor, held: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The causal depthwise convolution over [b, d, s] continuing from ``held`` [b, d, k-1];
    returns (activated output [b, d, s], the new held inputs)."""
    k = self.conv1d.kernel_size[0]
    if held is None:
        held = qkv.new_zeros(qkv.shape[0], qkv.shape[1], k - 1)
    full = torch.cat([held.to(qkv.dtype), qkv], dim=-1)
    out = F.conv1d(full, self.conv1d.weight, self.conv1d.bias, groups=qkv.shape[1])
    return self.act_fn(out), full[..., full.shape[-1] - (k - 1) :]


def stateful_forward(
    self: Any, hidden_states: torch.Tensor, attention_mask: Any, context: Any
) -> tuple[torch.Tensor, Any]:
    """``GatedDeltaNet.forward`` for generation: [s, b, h] -> (output, bias), states kept."""
    from megatron.core.ssm import gated_delta_net as gdn

    from anyspeed.features.ops.gated_delta import recurrent_gated_delta_rule

    s, b, _ = hidden_states.shape
    hidden_states = zero_padding(hidden_states, attention_mask)
    tp, heads = self.tp_size, self.num_value_heads
    x, _ = self.in_proj(hidden_states)
    x = x.transpose(0, 1)  # b, s, local
    qkv, gate, beta, alpha = torch.split(
        x, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp, heads // tp, heads // tp], -1
    )
    held = states_of(context)
    conv_held, rule_held = held.get(self.layer_number, (None, None))
    qkv, conv_held = _convolve(self, qkv.transpose(1, 2), conv_held)
    q, k, v = torch.split(
        qkv.transpose(1, 2), [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], -1
    )
    q = gdn.l2norm(q.reshape(b, s, -1, self.key_head_dim).contiguous())
    k = gdn.l2norm(k.reshape(b, s, -1, self.key_head_dim).contiguous())
    if heads // self.num_key_heads > 1:
        q, k = (t.repeat_interleave(heads // self.num_key_heads, dim=2) for t in (q, k))
    v = v.reshape(b, s, -1, self.value_head_dim)
    g = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)
    rule = recurrent_gated_delta_rule if s == 1 else gdn.chunk_gated_delta_rule
    kw = {} if s == 1 else {"use_qk_l2norm_in_kernel": False}
    out, rule_held = rule(
        q, k, v, g=g, beta=beta.sigmoid(), initial_state=rule_held, output_final_state=True, **kw
    )
    held[self.layer_number] = (conv_held, rule_held)
    y = self._apply_gated_norm(out, gate.reshape(b, s, -1, self.value_head_dim))
    y = y.reshape(b, s, -1).transpose(0, 1).contiguous()
    return self.out_proj(y)


def with_state(previous: Any) -> Any:
    """``GatedDeltaNet.forward`` that runs :func:`stateful_forward` under an inference context."""
    import functools

    @functools.wraps(previous)
    def forward(
        self: Any, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        context = kwargs.get("inference_context") or kwargs.get("inference_params")
        if context is None and len(args) >= 2:
            context = args[1]
        if context is None:  # training, or a forward without the cache: padding zeroed too
            hidden_states = zero_padding(hidden_states, attention_mask)
            return previous(self, hidden_states, attention_mask, *args, **kwargs)
        if kwargs.get("packed_seq_params") is not None:
            raise NotImplementedError("gated DeltaNet generation with packed sequences")
        return stateful_forward(self, hidden_states, attention_mask, context)

    return forward
