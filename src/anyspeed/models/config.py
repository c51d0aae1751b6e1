"""The one description of a GPT architecture, and its Megatron-LM command-line flags.

:class:`ModelConfig` is what presets, Hugging Face configs, ``anyspeed pretrain``'s flags and
checkpoints all turn into; :mod:`anyspeed.models.gpt` is the only place that turns it into
Megatron objects. The flag <-> field mapping is the table :data:`ARCH_FLAGS`: the pretraining
parser, :meth:`ModelConfig.from_args` and :meth:`ModelConfig.megatron_args` all read it, so a
new architecture field is one field plus one row here. ``ModelConfig`` is data and arithmetic:
what knows the families (the family of flags, HF configs) lives in ``presets`` and ``hf``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from anyspeed.models import counts
from anyspeed.models.arch_flags import ARCH_FLAGS, ArchFlag, add_arguments  # noqa: F401
from anyspeed.models.longrope import check_longrope
from anyspeed.models.mla_checks import check_mla
from anyspeed.models.moe import check_moe
from anyspeed.models.patterns import layer_pattern

MLA_FIELDS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
)
YARN_FIELDS = ("rotary_scaling_factor", "mscale", "mscale_all_dim")  # MLA's or a GPT's YaRN
GPT_YARN_FIELDS = (  # a GPT's YaRN; MLA's takes the first three
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_correction_range_round_to_int",
)
LINEAR_FIELDS = (
    "linear_attention_freq",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)

LONGROPE_FIELDS = (
    "longrope_short_factor",
    "longrope_long_factor",
    "longrope_original_max_position_embeddings",
)

LINEAR = "gated_delta_net"
DSA_FIELDS = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")


@dataclass(frozen=True)
class ModelConfig:
    """A GPT architecture in Megatron's vocabulary (defaults: a tiny LLaMA-style test model)."""

    name: str = "custom"
    family: str = "llama"  # the Hugging Face model_type ("llama" | "qwen2" | "qwen3" | "mistral")
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: one group per head (no GQA)
    vocab_size: int = 256  # rows of the embedding (already padded)
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    normalization: str = "RMSNorm"
    swiglu: bool = True
    position_embedding_type: str = "rope"  # "mrope": Qwen2-VL's 3-D positions
    # mRoPE: the rotary frequency pairs given to the temporal, height and width positions.
    mrope_section: tuple[int, ...] | None = None
    add_bias_linear: bool = False
    rotary_percent: float = 1.0
    # Mixture of Experts (``num_experts`` None: a dense model).
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_layer_freq: str = "1"  # Megatron's --moe-layer-freq: every N-th layer, or "[0]*1+[1]*3"
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    # Multi-latent attention (DeepSeek): low-rank Q and KV, separate rotary and value head sizes.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected at full rank
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  # per head, without the rotary part
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str = "rope"  # "yarn": YaRN-scaled RoPE (MLA)
    # Multi-token prediction (DeepSeek-V3): extra layers after the decoder, each predicting one
    # token further ahead from the previous depth's hidden state and the next token's embedding.
    mtp_num_layers: int | None = None
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # YaRN RoPE of a plain-attention model (--position-embedding-type yarn; GPT-OSS): its
    # factor and mscales are the fields above, these are the rest of HF's rope_parameters.
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True  # HF's "truncate"
    # GPT-OSS: attention sinks, sliding-window layers, the clamped quick-GELU GLU with offset.
    softmax_type: str = "vanilla"  # "learnable": one sink logit per head; "off-by-one": 0
    window_size: int | None = None  # keys before the row a windowed layer sees (None: all)
    window_attn_skip_freq: str | None = None  # "N": every N-th layer is full attention
    quick_geglu: bool = False  # GLU with x * sigmoid(1.702 x) instead of SiLU
    glu_linear_offset: float = 0.0  # added to the GLU's linear half
    activation_func_clamp_value: float | None = None  # clamp of both GLU halves
    # Gemma 2: a GLU with tanh-approximated GELU, norms on the attention's and the MLP's
    # outputs too ("sandwich"), tanh soft-capping of attention scores and of the output
    # logits, scores scaled by query_pre_attn_scalar^-0.5, embeddings scaled by sqrt(hidden).
    gelu_tanh: bool = False
    post_norm: bool = False
    attn_logit_softcapping: float | None = None
    output_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    input_embeds_norm: bool = False
    # Gemma 3: the sliding-window layers' own RoPE base (None: --rotary-base), and positions
    # divided by a factor (transformers' "linear" RoPE; Megatron applies it to --rotary-base's)
    rotary_base_local: float | None = None
    rotary_seq_len_interpolation_factor: float | None = None
    # LongRoPE (Phi-3.5, Phi-4-mini): each rotary frequency divided by its own factor, the short
    # set while a sequence fits the pretraining length, the long set beyond it; cos and sin
    # scaled by sqrt(1 + ln(max / original) / ln(original)), as transformers' "longrope".
    longrope_short_factor: tuple[float, ...] | None = None
    longrope_long_factor: tuple[float, ...] | None = None
    longrope_original_max_position_embeddings: int | None = None
    # Qwen3-Next: norms as x * (1 + w), a sigmoid gate on each attention head's output, and
    # gated DeltaNet (linear attention) layers between the full-attention ones.
    layernorm_zero_centered_gamma: bool = False
    attention_output_gate: bool = False
    experimental_attention_variant: str | None = None  # "gated_delta_net" | "dsa"
    linear_attention_freq: str | None = None  # "N": every N-th layer is full attention
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # DeepSeek-V3.2's sparse attention (variant "dsa", on MLA): the indexer's heads and their
    # size, and the keys each query attends to.
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None
    # Training-time settings Megatron keeps in its TransformerConfig; not part of the identity.
    init_method_std: float = field(default=0.02, compare=False)
    hidden_dropout: float = field(default=0.0, compare=False)
    attention_dropout: float = field(default=0.0, compare=False)
    moe_aux_loss_coeff: float = field(default=0.0, compare=False)
    moe_z_loss_coeff: float | None = field(default=None, compare=False)
    moe_router_bias_update_rate: float = field(default=1e-3, compare=False)
    moe_router_load_balancing_type: str = field(default="aux_loss", compare=False)
    moe_router_dtype: str | None = field(default=None, compare=False)
    moe_token_dispatcher_type: str = field(default="allgather", compare=False)
    moe_grouped_gemm: bool = field(default=False, compare=False)
    moe_expert_capacity_factor: float | None = field(default=None, compare=False)
    moe_pad_expert_input_to_capacity: bool = field(default=False, compare=False)
    moe_token_drop_policy: str = field(default="probs", compare=False)
    mtp_loss_scaling_factor: float = field(default=0.1, compare=False)
    dsa_indexer_loss_coeff: float = field(default=0.0, compare=False)
    dsa_indexer_use_sparse_loss: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.rope_type is None:  # unset (Megatron-LM's --rope-type): Megatron-Core's default
            object.__setattr__(self, "rope_type", "yarn" if self.multi_latent_attention else "rope")
        for name in ("moe_layer_freq", "linear_attention_freq"):  # Megatron-LM: int or list
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, str(value).replace(" ", ""))
        for name in ("mrope_section", *LONGROPE_FIELDS[:2]):  # lists (JSON, Megatron-LM's args)
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    def same_architecture(self, other: ModelConfig) -> list[str]:
        """The fields (compared ones, by meaning) in which ``other`` describes another model:
        ``--moe-layer-freq 1`` and ``[1]*4`` are the same four MoE layers, ``rope_type`` is
        the RoPE applied (:meth:`rope_kind`), llama3 ``rope_scaling`` its factor."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "moe_layer_freq" and self.is_moe and other.is_moe:
                a, b = self.moe_layers(), other.moe_layers()
            if f.name == "rope_type":
                a, b = self.rope_kind(), other.rope_kind()
            if f.name == "rope_scaling":  # llama3's factor (Megatron fixes the rest)
                a, b = [(m.rope_scaling or {}).get("factor") for m in (self, other)]
            if (f.compare or f.name == "rope_scaling") and a != b:
                out.append(f.name)
        return out

    def rope_kind(self) -> str:
        """The RoPE applied: only MLA reads ``rope_type``; YaRN at factor 1 is plain RoPE."""
        yarn = self.rope_type == "yarn" and self.rotary_scaling_factor != 1.0
        return "yarn" if self.multi_latent_attention and yarn else "rope"

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def moe_layers(self) -> list[bool]:
        """Which layers are MoE layers (all False for a dense model)."""
        if not self.is_moe:
            return [False] * self.num_layers
        return [bool(x) for x in layer_pattern(self.moe_layer_freq, self.num_layers)]

    @property
    def gated(self) -> bool:
        """A gated linear unit (SwiGLU, quick-GeGLU or tanh GeGLU): fc1 holds [gate; up]."""
        return self.swiglu or self.quick_geglu or self.gelu_tanh

    def window_layers(self) -> list[bool]:
        """Which layers attend through the sliding window (Megatron's rule: with skip
        frequency N, layer numbers 1.. that N divides are full attention)."""
        if self.window_size is None:
            return [False] * self.num_layers
        freq = self.window_attn_skip_freq
        if freq is None:
            return [True] * self.num_layers
        if str(freq).isdigit():
            return [(i + 1) % int(freq) != 0 for i in range(self.num_layers)]
        return [bool(x) for x in layer_pattern(freq, self.num_layers)]

    def linear_attention_layers(self) -> list[bool]:
        """Which layers are gated DeltaNet layers (Megatron's rule: with frequency N, layer
        numbers 1.. that N divides are full attention; a list: 1 = linear attention)."""
        if self.experimental_attention_variant != LINEAR:
            return [False] * self.num_layers
        freq = self.linear_attention_freq
        if freq is None:
            raise ValueError(
                "--experimental-attention-variant gated_delta_net needs "
                "--linear-attention-freq (e.g. 4: every 4th layer full "
                "attention)"
            )
        if str(freq).isdigit():
            return [(i + 1) % int(freq) != 0 for i in range(self.num_layers)]
        return [bool(x) for x in layer_pattern(freq, self.num_layers, "--linear-attention-freq")]

    def check(self) -> None:
        """ValueError (one line, naming the flag) when the MoE settings cannot build."""
        check_moe(self)
        check_mla(self)
        if self.swiglu + self.quick_geglu + self.gelu_tanh > 1:
            raise ValueError(
                "--swiglu, --quick-geglu and --gelu-tanh are three activations: pass one"
            )
        if self.window_size is not None:
            self.window_layers()  # the --window-attn-skip-freq pattern fits --num-layers
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                "--linear-num-value-heads must be a multiple of --linear-num-key-heads"
            )
        self.linear_attention_layers()
        check_longrope(self)

    @property
    def longrope(self) -> bool:
        """LongRoPE's frequency factors are set (``--rope-scaling-type longrope``)."""
        return self.longrope_long_factor is not None

    @property
    def gqa(self) -> bool:
        return self.num_query_groups != self.num_attention_heads

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for checkpoints): ``ModelConfig(**d)`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The inverse of :meth:`to_dict`; unknown keys (from a newer anyspeed) are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(values) - names)
        if extra:
            raise ValueError(f"unknown model fields {extra} (written by a newer anyspeed?)")
        return cls(**values)

    @staticmethod
    def flag_values(args: argparse.Namespace) -> dict[str, Any]:
        """The architecture fields checked pretraining ``args`` set (all but name and family)."""
        values = {row.field: row.read(args) for row in ARCH_FLAGS}
        if not getattr(args, "group_query_attention", False):
            values["num_query_groups"] = None
        if getattr(args, "use_rope_scaling", False):
            values["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor}
        if getattr(args, "rope_scaling_type", None) != "longrope":  # (YaRN's length in MindSpeed's)
            values.update(dict.fromkeys(LONGROPE_FIELDS))
        return values

    @classmethod
    def from_args(cls, args: argparse.Namespace, family: str) -> ModelConfig:
        """The architecture ``args`` describe, of family ``family`` (see ``model_from_args``)."""
        name = getattr(args, "model", None)
        return cls(name=name or "custom", family=family, **cls.flag_values(args))

    def megatron_args(self) -> list[str]:
        """The Megatron-LM / MindSpeed-LLM flags that describe this architecture."""
        out: list[str] = []
        gpt_yarn = self.position_embedding_type == "yarn"
        mla_yarn = self.multi_latent_attention and self.rope_type == "yarn"
        yarn = GPT_YARN_FIELDS if gpt_yarn else GPT_YARN_FIELDS[:3] if mla_yarn else ()
        for row in ARCH_FLAGS:
            if row.field in MLA_FIELDS and not self.multi_latent_attention:
                continue
            if row.field in YARN_FIELDS and not (self.multi_latent_attention or gpt_yarn):
                continue
            if row.field in GPT_YARN_FIELDS and row.field not in yarn:
                continue
            if row.field in LINEAR_FIELDS and self.experimental_attention_variant != LINEAR:
                continue
            if row.field in DSA_FIELDS and self.experimental_attention_variant != "dsa":
                continue
            if row.arch and (row.field != "num_query_groups" or self.gqa):
                out += row.emit(getattr(self, row.field))
        if self.gqa:
            out += ["--group-query-attention"]
        if self.rope_scaling:
            out += ["--use-rope-scaling", "--rope-scaling-factor", str(self.rope_scaling["factor"])]
        if self.longrope:
            out += ["--rope-scaling-type", "longrope"]
        return out

    def num_parameters(self) -> int:
        """Parameter count (embeddings included, tied ones counted once)."""
        return counts.num_parameters(self)

    def active_parameters(self) -> int:
        """Parameters a token passes through in the decoder (top-k experts; no MTP layers)."""
        return counts.active_parameters(self)

    def mtp_parameters(self) -> int:
        """Parameters of the multi-token prediction layers."""
        return counts.mtp_parameters(self)

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (:func:`anyspeed.models.counts.flops_per_token`)."""
        return counts.flops_per_token(self, seq_length)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad the vocabulary to a multiple of ``divisible_by`` x TP."""
    m = divisible_by * tp
    return int(math.ceil(vocab / m) * m)
