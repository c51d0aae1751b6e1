"""The flag table of :class:`~anyspeed.models.config.ModelConfig`: each architecture field and
its Megatron-LM flag, read by the pretraining parser, ``ModelConfig.from_args`` and
``ModelConfig.megatron_args`` alike (a new field is one row here)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from anyspeed.argv import factor_list


def window_type(text: str) -> int:
    """``--window-size``: Megatron-LM's ``(left,right)`` pair or one number, read as the keys
    before the row a windowed layer sees (causal only: right must be 0)."""
    parts = [p for p in text.strip("()[] ").replace(" ", "").split(",") if p]
    if not parts or len(parts) > 2 or not all(p.lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"cannot read {text!r} (e.g. 127 or '(127,0)')")
    left, right = int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
    if right != 0:  # (a negative left is the range check's: "--window-size must be >= 0")
        raise argparse.ArgumentTypeError(f"{text!r}: only causal windows (right 0) are supported")
    return left


@dataclass(frozen=True)
class ArchFlag:
    """One row of the flag table: a :class:`ModelConfig` field and its Megatron-LM flag."""

    field: str
    flag: str
    type: type | None  # None: a switch (store_true)
    default: Any = None  # Megatron-LM's default when the flag is absent
    invert: bool = False  # the switch turns the field off (--disable-bias-linear)
    choices: tuple[str, ...] | None = None
    arch: bool = True  # part of the architecture (written by megatron_args)
    many: bool = False  # several values (``--mrope-section 16 24 24``), read as a tuple

    def add_to(self, parser: argparse._ActionsContainer) -> None:
        if self.type is None:
            parser.add_argument(self.flag, action="store_true")
        else:
            parser.add_argument(
                self.flag,
                type=self.type,
                default=self.default,
                choices=self.choices,
                nargs="+" if self.many else None,
            )

    def read(self, args: argparse.Namespace) -> Any:
        """The field's value in ``args``; an argument left unset (absent or None, as
        Megatron-LM stores ``--rope-type``) reads as the flag's default."""
        value = getattr(args, self.flag[2:].replace("-", "_"), None)
        if value is None:
            value = self.default
        if self.type is None:
            return (not value) if self.invert else bool(value)
        return tuple(value) if self.many and value is not None else value

    def emit(self, value: Any) -> list[str]:
        if self.type is None:
            return [self.flag] if bool(value) != self.invert else []
        if value is None:
            return []
        if self.many:
            return [self.flag, *(str(v) for v in value)]
        if self.type is factor_list:
            return [self.flag, ",".join(repr(float(v)) for v in value)]
        if self.type is int or self.type is window_type:
            value = int(value)
        return [self.flag, str(value)]


ARCH_FLAGS: tuple[ArchFlag, ...] = (
    ArchFlag("num_layers", "--num-layers", int),
    ArchFlag("hidden_size", "--hidden-size", int),
    ArchFlag("ffn_hidden_size", "--ffn-hidden-size", int),
    ArchFlag("num_attention_heads", "--num-attention-heads", int),
    ArchFlag("num_query_groups", "--num-query-groups", int),
    ArchFlag("kv_channels", "--kv-channels", int),
    ArchFlag("max_position_embeddings", "--max-position-embeddings", int),
    ArchFlag(
        "position_embedding_type",
        "--position-embedding-type",
        str,
        "learned_absolute",
        choices=("rope", "learned_absolute", "yarn", "mrope"),
    ),
    ArchFlag("mrope_section", "--mrope-section", int, many=True),
    ArchFlag("rotary_base", "--rotary-base", int, 10000),
    ArchFlag("rotary_percent", "--rotary-percent", float, 1.0),
    ArchFlag(
        "normalization", "--normalization", str, "LayerNorm", choices=("LayerNorm", "RMSNorm")
    ),
    ArchFlag("norm_epsilon", "--norm-epsilon", float, 1e-5),
    ArchFlag("swiglu", "--swiglu", None),
    ArchFlag("add_bias_linear", "--disable-bias-linear", None, invert=True),
    ArchFlag("add_qkv_bias", "--add-qkv-bias", None),
    ArchFlag("qk_layernorm", "--qk-layernorm", None),
    ArchFlag("tie_embeddings", "--untie-embeddings-and-output-weights", None, invert=True),
    ArchFlag("vocab_size", "--padded-vocab-size", int),
    ArchFlag("num_experts", "--num-experts", int),
    ArchFlag("moe_ffn_hidden_size", "--moe-ffn-hidden-size", int),
    ArchFlag("moe_router_topk", "--moe-router-topk", int, 2),
    ArchFlag("moe_layer_freq", "--moe-layer-freq", str, "1"),
    ArchFlag("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", int),
    ArchFlag("moe_shared_expert_gate", "--moe-shared-expert-gate", None),
    ArchFlag(
        "moe_router_score_function",
        "--moe-router-score-function",
        str,
        "softmax",
        choices=("softmax", "sigmoid"),
    ),
    ArchFlag("moe_router_pre_softmax", "--moe-router-pre-softmax", None),
    ArchFlag("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", float),
    ArchFlag("moe_router_num_groups", "--moe-router-num-groups", int),
    ArchFlag("moe_router_group_topk", "--moe-router-group-topk", int),
    ArchFlag("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", None),
    ArchFlag("multi_latent_attention", "--multi-latent-attention", None),
    ArchFlag("q_lora_rank", "--q-lora-rank", int),
    ArchFlag("kv_lora_rank", "--kv-lora-rank", int, 32),
    ArchFlag("qk_head_dim", "--qk-head-dim", int, 128),
    ArchFlag("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", int, 64),
    ArchFlag("v_head_dim", "--v-head-dim", int, 128),
    ArchFlag("rope_type", "--rope-type", str, "rope", choices=("rope", "yarn")),
    ArchFlag("mtp_num_layers", "--mtp-num-layers", int),
    ArchFlag("rotary_scaling_factor", "--rotary-scaling-factor", float, 1.0),
    ArchFlag("mscale", "--mscale", float, 1.0),
    ArchFlag("mscale_all_dim", "--mscale-all-dim", float, 0.0),
    ArchFlag(
        "yarn_original_max_position_embeddings",
        "--yarn-original-max-position-embeddings",
        int,
        4096,
    ),
    ArchFlag("yarn_beta_fast", "--yarn-beta-fast", float, 32.0),
    ArchFlag("yarn_beta_slow", "--yarn-beta-slow", float, 1.0),
    ArchFlag(
        "yarn_correction_range_round_to_int",
        "--yarn-no-round-correction-range",
        None,
        invert=True,
    ),
    ArchFlag(
        "softmax_type",
        "--softmax-type",
        str,
        "vanilla",
        choices=("vanilla", "off-by-one", "learnable"),
    ),
    ArchFlag("window_size", "--window-size", window_type),
    ArchFlag("window_attn_skip_freq", "--window-attn-skip-freq", str),
    ArchFlag("quick_geglu", "--quick-geglu", None),
    ArchFlag("glu_linear_offset", "--glu-linear-offset", float, 0.0),
    ArchFlag("activation_func_clamp_value", "--activation-func-clamp-value", float),
    ArchFlag("gelu_tanh", "--gelu-tanh", None),
    ArchFlag("post_norm", "--post-norm", None),
    ArchFlag("attn_logit_softcapping", "--attn-logit-softcapping", float),
    ArchFlag("output_logit_softcapping", "--output-logit-softcapping", float),
    ArchFlag("query_pre_attn_scalar", "--query-pre-attn-scalar", float),
    ArchFlag("input_embeds_norm", "--input-embeds-norm", None),
    ArchFlag("rotary_base_local", "--rotary-base-local", float),
    ArchFlag("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor", float),
    ArchFlag("longrope_short_factor", "--short-factor", factor_list),
    ArchFlag("longrope_long_factor", "--long-factor", factor_list),
    ArchFlag(
        "longrope_original_max_position_embeddings",
        "--rope-scaling-original-max-position-embeddings",
        int,
    ),
    ArchFlag("layernorm_zero_centered_gamma", "--apply-layernorm-1p", None),
    ArchFlag("attention_output_gate", "--attention-output-gate", None),
    ArchFlag(
        "experimental_attention_variant",
        "--experimental-attention-variant",
        str,
        choices=("gated_delta_net", "dsa"),
    ),
    ArchFlag("linear_attention_freq", "--linear-attention-freq", str),
    ArchFlag("linear_conv_kernel_dim", "--linear-conv-kernel-dim", int, 4),
    ArchFlag("linear_key_head_dim", "--linear-key-head-dim", int, 128),
    ArchFlag("linear_value_head_dim", "--linear-value-head-dim", int, 128),
    ArchFlag("linear_num_key_heads", "--linear-num-key-heads", int, 16),
    ArchFlag("linear_num_value_heads", "--linear-num-value-heads", int, 32),
    ArchFlag("dsa_indexer_n_heads", "--dsa-indexer-n-heads", int),
    ArchFlag("dsa_indexer_head_dim", "--dsa-indexer-head-dim", int),
    ArchFlag("dsa_indexer_topk", "--dsa-indexer-topk", int),
    ArchFlag("dsa_indexer_loss_coeff", "--dsa-indexer-loss-coeff", float, 0.0, arch=False),
    ArchFlag("dsa_indexer_use_sparse_loss", "--dsa-indexer-use-sparse-loss", None, arch=False),
    ArchFlag("mtp_loss_scaling_factor", "--mtp-loss-scaling-factor", float, 0.1, arch=False),
    ArchFlag("init_method_std", "--init-method-std", float, 0.02, arch=False),
    ArchFlag("hidden_dropout", "--hidden-dropout", float, 0.1, arch=False),
    ArchFlag("attention_dropout", "--attention-dropout", float, 0.1, arch=False),
    ArchFlag("moe_aux_loss_coeff", "--moe-aux-loss-coeff", float, 0.0, arch=False),
    ArchFlag("moe_z_loss_coeff", "--moe-z-loss-coeff", float, arch=False),
    ArchFlag(
        "moe_router_bias_update_rate", "--moe-router-bias-update-rate", float, 1e-3, arch=False
    ),
    ArchFlag(
        "moe_router_load_balancing_type",
        "--moe-router-load-balancing-type",
        str,
        "aux_loss",
        choices=(
            "aux_loss",
            "seq_aux_loss",
            "global_aux_loss",
            "sinkhorn",
            "none",
            "softmax_topk",
            "group_limited_greedy",
        ),  # MindSpeed-LLM's: mindspeed-moe-flags
        arch=False,
    ),
    ArchFlag("moe_router_dtype", "--moe-router-dtype", str, choices=("fp32", "fp64"), arch=False),
    ArchFlag(
        "moe_token_dispatcher_type",
        "--moe-token-dispatcher-type",
        str,
        "allgather",
        choices=("allgather", "alltoall", "alltoall_seq", "flex"),
        arch=False,
    ),
    ArchFlag("moe_grouped_gemm", "--moe-grouped-gemm", None, arch=False),
    ArchFlag("moe_expert_capacity_factor", "--moe-expert-capacity-factor", float, arch=False),
    ArchFlag(
        "moe_pad_expert_input_to_capacity",
        "--moe-pad-expert-input-to-capacity",
        None,
        arch=False,
    ),
    ArchFlag(
        "moe_token_drop_policy",
        "--moe-token-drop-policy",
        str,
        "probs",
        choices=("probs", "position"),
        arch=False,
    ),
)


def add_arguments(parser: argparse._ActionsContainer) -> None:
    """Add the architecture flags (the table plus GQA and RoPE-scaling switches)."""
    for row in ARCH_FLAGS:
        row.add_to(parser)
    parser.add_argument("--group-query-attention", action="store_true")
    parser.add_argument("--use-rope-scaling", action="store_true")
    parser.add_argument("--rope-scaling-factor", type=float, default=8.0)
