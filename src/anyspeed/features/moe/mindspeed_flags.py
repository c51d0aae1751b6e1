"""Level-0 feature ``mindspeed-moe-flags``: MindSpeed(-LLM)'s MoE flag names as Megatron's.

MindSpeed-LLM launch scripts describe routers and shared experts with their own names. Each maps
onto Megatron-Core's own options, rewritten in the parsed namespace before the model type reads
it (idempotent: the checks run in the launcher and again in every rank):

* ``--n-shared-experts N`` -> ``--moe-shared-expert-intermediate-size N x expert FFN``
* ``--shared-expert-gate`` -> ``--moe-shared-expert-gate``
* ``--first-k-dense-replace K`` -> ``--moe-layer-freq [0]*K+[1]*(L-K)``
* ``--moe-router-load-balancing-type softmax_topk`` -> softmax over all experts, then top-k
  (``--moe-router-pre-softmax``), no balancing loss; with ``--norm-topk-prob`` the top-k
  probabilities are renormalised, which is Megatron's default (softmax after top-k)
* ``group_limited_greedy`` -> the same scores, top-k within ``--moe-router-num-groups`` /
  ``--moe-router-group-topk`` (both required)
* ``--moe-router-pre-softmax --norm-topk-prob`` under ``aux_loss`` -> softmax after top-k
  (MindSpeed-LLM renormalises the top-k of the softmax over all experts: the same weights)
* ``--seq-aux`` -> ``seq_aux_loss``; ``--router-gating-in-fp32`` and
  ``--topk-softmax-in-fp32`` -> ``--moe-router-dtype fp32``
"""

from __future__ import annotations

import argparse
import itertools

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag

_GREEDY = ("softmax_topk", "group_limited_greedy")


class MindSpeedMoEFlags(Feature):
    name = "mindspeed-moe-flags"
    level = 0
    description = "MindSpeed-LLM's MoE router and shared-expert flags, as Megatron's options"
    flags = (
        "--n-shared-experts",
        "--shared-expert-gate",
        "--first-k-dense-replace",
        "--seq-aux",
        "--norm-topk-prob",
        "--router-gating-in-fp32",
        "--topk-softmax-in-fp32",
    )

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--n-shared-experts",
            type=int,
            default=None,
            help="MindSpeed: shared experts, each of the expert FFN size",
        )
        add_flag(
            parser,
            "--first-k-dense-replace",
            type=int,
            default=None,
            help="MindSpeed: the first K layers are dense, the rest MoE",
        )
        for flag, what in (
            ("--shared-expert-gate", "= --moe-shared-expert-gate"),
            ("--seq-aux", "= --moe-router-load-balancing-type seq_aux_loss"),
            ("--norm-topk-prob", "renormalise the top-k probabilities"),
            ("--router-gating-in-fp32", "= --moe-router-dtype fp32"),
            ("--topk-softmax-in-fp32", "= --moe-router-dtype fp32"),
        ):
            add_flag(parser, flag, action="store_true", help=f"MindSpeed: {what}")
        add_flag(
            parser,
            "--moe-zero-memory",
            choices=("disable", "level0", "level1"),
            default=None,
            help="MindSpeed: MoE activation memory by recompute (level0: the experts' "
            "activation, level1: the MoE layer; Megatron's selective recompute)",
        )
        add_flag(parser, "--moe-zero-memory-num-layers", type=int, default=None, help="MindSpeed")

    def flag_notes(self) -> dict[str, str]:
        return {
            "--n-shared-experts N": "--moe-shared-expert-intermediate-size N x expert FFN",
            "--shared-expert-gate": "--moe-shared-expert-gate",
            "--first-k-dense-replace K": "--moe-layer-freq [0]*K+[1]*(L-K)",
            "--moe-router-load-balancing-type softmax_topk": "softmax over all, top-k, no "
            "balancing loss (--moe-router-pre-softmax; with --norm-topk-prob: softmax after "
            "top-k)",
            "--moe-router-load-balancing-type group_limited_greedy": "the same, top-k within "
            "--moe-router-num-groups / --moe-router-group-topk",
            "--seq-aux": "--moe-router-load-balancing-type seq_aux_loss",
            "--router-gating-in-fp32": "--moe-router-dtype fp32",
            "--topk-softmax-in-fp32": "--moe-router-dtype fp32",
            "--moe-zero-memory level0|level1": "--recompute-granularity selective "
            "--recompute-modules moe_act | moe (added to the modules asked)",
            "--moe-router-pre-softmax --norm-topk-prob": "softmax after top-k (aux_loss: the "
            "renormalised top-k of a softmax over all is the softmax over the top-k)",
        }

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        """Rewrite the MindSpeed names in ``args`` into Megatron's (one-line error if they
        contradict an explicit Megatron flag)."""
        shared = getattr(args, "n_shared_experts", None)
        if shared:
            ffn = getattr(args, "moe_ffn_hidden_size", None)
            ffn = ffn or getattr(args, "ffn_hidden_size", None)
            if ffn is None:
                raise FeatureError("--n-shared-experts needs --moe-ffn-hidden-size")
            args.moe_shared_expert_intermediate_size = shared * ffn
        if getattr(args, "shared_expert_gate", False):
            args.moe_shared_expert_gate = True
        if getattr(args, "router_gating_in_fp32", False) or getattr(
            args, "topk_softmax_in_fp32", False
        ):
            args.moe_router_dtype = "fp32"
        self._dense_first(args)
        self._router(args)
        _zero_memory(args)
        _check_moe_act(args)

    def _dense_first(self, args: argparse.Namespace) -> None:
        k = getattr(args, "first_k_dense_replace", None)
        if k is None:
            return
        layers = getattr(args, "num_layers", None) or 0
        if not -1 <= k <= layers:
            raise FeatureError(f"--first-k-dense-replace {k} must be within --num-layers {layers}")
        k = max(k, 0)  # MindSpeed-LLM's -1: layer i is MoE from i >= -1, i.e. every layer
        freq = str(getattr(args, "moe_layer_freq", "1")).replace(" ", "")
        pattern = f"[0]*{k}+[1]*{layers - k}" if k < layers else f"[0]*{k}"
        if freq != "1" and freq.lstrip("-").isdigit() and int(freq) != 0:
            # MindSpeed-LLM's rule: MoE when i >= K and i % --moe-layer-freq == 0
            moe = [int(i >= k and i % int(freq) == 0) for i in range(layers)]
            runs = [(x, len(list(g))) for x, g in itertools.groupby(moe)]
            pattern = "+".join(f"[{x}]*{n}" for x, n in runs) or "[]"
        elif freq not in ("1", pattern):
            raise FeatureError("--first-k-dense-replace and --moe-layer-freq contradict: give one")
        args.moe_layer_freq = pattern
        args.first_k_dense_replace = None  # rewritten: later passes read --moe-layer-freq only

    def _router(self, args: argparse.Namespace) -> None:
        kind = getattr(args, "moe_router_load_balancing_type", None)
        seq_aux = getattr(args, "seq_aux", False)
        if kind in _GREEDY:
            if kind == "group_limited_greedy" and not (
                getattr(args, "moe_router_num_groups", None)
                and getattr(args, "moe_router_group_topk", None)
            ):
                raise FeatureError(
                    "--moe-router-load-balancing-type group_limited_greedy needs "
                    "--moe-router-num-groups and --moe-router-group-topk"
                )
            args.moe_router_pre_softmax = not getattr(args, "norm_topk_prob", False)
            kind = args.moe_router_load_balancing_type = "none"
        elif (
            kind in (None, "aux_loss")
            and getattr(args, "norm_topk_prob", False)
            and getattr(args, "moe_router_pre_softmax", False)
        ):  # MindSpeed-LLM renormalises aux_loss's pre-softmax top-k: the top-k's own softmax
            args.moe_router_pre_softmax = False
        if seq_aux and kind in (None, "none", "aux_loss", "seq_aux_loss"):
            args.moe_router_load_balancing_type = "seq_aux_loss"


# MindSpeed's --moe-zero-memory level -> the Megatron recompute module closest in what it keeps
_ZERO_MEMORY = {"level0": "moe_act", "level1": "moe"}


def _zero_memory(args: argparse.Namespace) -> None:
    """``--moe-zero-memory level0|level1`` (MindSpeed's MoE activation recompute with
    overlapped communication) as Megatron's selective recompute of the experts' activation
    (level0) or of the whole MoE layer (level1), added to the modules asked; under full
    recompute it adds nothing. Marks itself done."""
    level = getattr(args, "moe_zero_memory", None)
    layers = getattr(args, "moe_zero_memory_num_layers", None)
    if level in (None, "disable"):
        if layers is not None:
            raise FeatureError("--moe-zero-memory-num-layers needs --moe-zero-memory level1")
        return
    if not getattr(args, "num_experts", None):
        raise FeatureError(f"--moe-zero-memory {level}: the model has no experts (--num-experts)")
    if layers is not None:
        raise FeatureError(
            "--moe-zero-memory-num-layers: Megatron's selective recompute covers every layer; "
            "drop it (or use --recompute-granularity full --recompute-num-layers N)"
        )
    if getattr(args, "recompute_granularity", None) != "full":
        modules = list(getattr(args, "recompute_modules", None) or [])
        if getattr(args, "recompute_granularity", None) == "selective" and not modules:
            modules = ["core_attn"]  # Megatron's default for selective, kept
        args.recompute_granularity = "selective"
        args.recompute_modules = list(dict.fromkeys([*modules, _ZERO_MEMORY[level]]))
    full = getattr(args, "recompute_granularity", None) == "full"
    if level == "level0" and not full and not getattr(args, "moe_grouped_gemm", False):
        raise FeatureError(
            "--moe-zero-memory level0 recomputes the grouped experts' activation (Megatron's "
            "moe_act needs --moe-grouped-gemm): add --moe-grouped-gemm, or use level1"
        )
    args.moe_zero_memory = None  # rewritten: later passes read the recompute flags only


def _check_moe_act(args: argparse.Namespace) -> None:
    """Megatron refuses ``moe_act`` recompute without grouped experts inside every rank (a
    traceback); here it is one line before start."""
    modules = getattr(args, "recompute_modules", None) or []
    if "moe_act" in modules and not getattr(args, "moe_grouped_gemm", False):
        raise FeatureError(
            "--recompute-modules moe_act needs --moe-grouped-gemm (Megatron recomputes the "
            "grouped experts' activation only); recompute moe or mlp instead"
        )
