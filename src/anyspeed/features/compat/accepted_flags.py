"""Level-0 feature ``accepted-flags``: Megatron-LM / MindSpeed flags that change nothing here.

Existing launch scripts (Megatron-LM's examples, MindSpeed-LLM's Qwen2.5-7B pretrain script)
pass kernel and performance switches that mean nothing on the anyspeed path: the CUDA fusions
they turn off are never used, the values they choose are what anyspeed does anyway. They are
accepted -- never silently: ``anyspeed features`` lists each with the reason -- so the scripts
carry over. A parser that already defines one (Megatron-LM's does, for most) keeps its own.
MindSpeed's fused-kernel flags are not here: each switches on one of anyspeed's level-1 kernels,
and the note says which.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from anyspeed.features.base import Feature, add_flag

_FUSION_OFF = "a CUDA fusion that is never used here (the portable config switches it off)"

# flag -> (takes a value: False, True or "+" for one or more, why it changes nothing here)
NOOPS: dict[str, tuple[bool | str, str]] = {
    "--use-mcore-models": (False, "anyspeed builds Megatron-Core models only"),
    "--no-masked-softmax-fusion": (False, "masked softmax: " + _FUSION_OFF),
    "--no-bias-gelu-fusion": (False, "bias-GeLU: " + _FUSION_OFF),
    "--no-bias-swiglu-fusion": (
        False,
        "Megatron's bias-SwiGLU: off in the portable config; --optimization-level chooses "
        "fused-swiglu (on CUDA Megatron's torch.compile'd one, elsewhere anyspeed's)",
    ),
    "--no-bias-dropout-fusion": (False, "bias-dropout: " + _FUSION_OFF),
    "--no-rope-fusion": (
        False,
        "Megatron's TE/apex RoPE: "
        + _FUSION_OFF
        + "; --optimization-level chooses anyspeed's fused-rope",
    ),
    "--no-gradient-accumulation-fusion": (
        False,
        "gradient-accumulation fusion needs a CUDA kernel: always off here",
    ),
    "--no-persist-layer-norm": (False, "apex persistent LayerNorm: never used here"),
    "--use-cpu-initialization": (False, "weights are always initialised on the CPU"),
    "--attention-softmax-in-fp32": (
        False,
        "softmax already runs in fp32 (Megatron-Core's default)",
    ),
    "--distributed-backend": (
        True,
        "process groups use this device's backend; nccl is mapped to it (device-compat)",
    ),
    "--transformer-impl": (
        True,
        "anyspeed builds Megatron's local spec; transformer_engine is "
        "refused off CUDA without Transformer Engine (cuda-only-options)",
    ),
    "--no-create-attention-mask-in-dataloader": (
        False,
        "anyspeed's data path builds a mask only for --reset-attention-mask",
    ),
    "--log-timers-to-tensorboard": (False, "anyspeed pretrain writes no timer series"),
    "--log-memory-to-tensorboard": (False, "anyspeed pretrain writes no memory series"),
    "--log-validation-ppl-to-tensorboard": (
        False,
        "anyspeed pretrain writes no separate validation-perplexity series",
    ),
    "--num-workers": (True, "anyspeed pretrain reads samples in the training process"),
    "--o2-gradient": (
        False,
        "MindSpeed-LLM registers it without a use; gradients accumulate in Megatron's "
        "main-grad buffers (fp32 with --accumulate-allreduce-grads-in-fp32); --o2-optimizer "
        "keeps Adam's moments in bf16",
    ),
    "--dataloader-type": (
        True,
        "single and cyclic both read the samples in the seeded order drawn for each epoch "
        "(cyclic reshuffles an already shuffled index: the same distribution); "
        "--no-shuffle reads fine-tuning data in file order",
    ),
    "--moe-permutation-async-comm": (
        False,
        "MindSpeed's asynchronous all-gathers around MoE "
        "token permutation: the dispatchers here are synchronous "
        "(gloo has no overlap to gain)",
    ),
    "--lora-fusion": (
        False,
        "MindSpeed-LLM's CCLoRA: NPU kernels fusing each adapter's product with the layer's "
        "communication; here the adapters' rank-r products run unfused",
    ),
    "--lora-ckpt-filter": (False, "a LoRA checkpoint holds only the adapters anyway"),
    "--no-shared-storage": (
        False,
        "MindSpeed-LLM builds the dataset index once per node without shared storage; "
        "anyspeed's instruction and pretraining data need no index cache",
    ),
    "--enable-hf2mg-convert": (
        False,
        "a Hugging Face --load is converted at start-up anyway (once, then reused); "
        "--enable-mg2hf-convert is a flag of its own",
    ),
    "--model-type-hf": (True, "the family comes from --load's config.json"),
    "--tokenizer-padding-side": (
        True,
        "the data is tokenized already: pretraining documents are packed, not padded, and "
        "instruction samples are padded after their tokens with the padding out of the loss",
    ),
    "--spec": (
        "+",
        "a MindSpeed-LLM layer spec module: anyspeed builds Megatron-Core's local spec from "
        "the model's architecture (--qk-layernorm, MLA, MoE, ...)",
    ),
    "--moe-permute-fusion": (
        False,
        "Transformer Engine's / MindSpeed's fused token permutation: the permutation here is "
        "Megatron's portable one (the same tokens in the same order)",
    ),
    "--gemm-gradient-accumulation-fusion": (
        False,
        "MindSpeed's NPU kernel accumulating weight gradients inside the GEMM: gradients "
        "accumulate in Megatron's main-grad buffers",
    ),
    "--use-ascend-coc": (False, "Ascend's communication-computation overlap (an NPU kernel)"),
    "--coc-fused-kernel": (False, "Ascend's fused communication-computation kernel"),
    "--use-ascend-mc2": (False, "Ascend's MC2 fused matmul-communication kernel"),
    "--moe-fb-overlap": (
        False,
        "MindSpeed's overlap of one micro-batch's forward with another's backward in MoE "
        "layers (CUDA/NPU streams): the passes run one after the other, with the same results",
    ),
    "--mla-fa-without-pad": (
        False,
        "MindSpeed's flash attention for MLA without padding the value head dim: attention "
        "here takes unequal query/value head dims as they are",
    ),
    "--shape-order": (True, "MindSpeed's attention tensor layout for its NPU kernel"),
    "--mtp-mem-efficient-logits": (
        False,
        "MindSpeed's chunked MTP logits (memory only): the MTP loss here is Megatron's",
    ),
    "--use-fused-lightning-indexer": (False, "MindSpeed's fused DSA indexer (an NPU kernel)"),
    "--use-triton-gdn": (
        False,
        "MindSpeed-LLM's Triton gated-delta kernel: DeltaNet layers run fla's kernel where it "
        "is installed, else anyspeed's chunked rule (the same recurrence)",
    ),
    "--mamba-chunk-size": (
        True,
        "the chunk length of MindSpeed-LLM's gated-delta kernel, a speed setting: the chunked "
        "rule here computes the same recurrence",
    ),
    "--mamba-expand": (
        True,
        "unused by MindSpeed-LLM's gated DeltaNet layers (their sizes are --linear-key-head-dim, "
        "--linear-value-head-dim, --linear-num-key-heads, --linear-num-value-heads)",
    ),
    "--loss-chunk-size": (True, "the chunk of MindSpeed-LLM's --loss-compute-mode chunk"),
    "--rmsnorm-weight-in-fp32": (
        False,
        "MindSpeed-LLM multiplies by the norm weight in fp32; here the product is in the "
        "model's dtype (a rounding difference under --bf16/--fp16 only)",
    ),
    "--input-layernorm-in-fp32": (
        False,
        "MindSpeed-LLM computes the input norm in fp32; here it runs in the model's dtype (a "
        "rounding difference under --bf16/--fp16 only)",
    ),
    "--init-norm-weight-in-fp32": (
        False,
        "MindSpeed-LLM keeps the DSA indexer's norm weights in fp32; here they are in the "
        "model's dtype, over the optimizer's fp32 master weights",
    ),
    "--use-fused-moe-token-permute-and-unpermute": (
        False,
        "MindSpeed's fused MoE token permutation (an NPU kernel): Megatron's portable "
        "permutation, the same tokens in the same order",
    ),
    "--disable-gloo-group": (
        False,
        "MindSpeed's switch against gloo side groups on NPU clusters: anyspeed creates the "
        "groups its device's backend needs",
    ),
    "--use-fused-lightning-indexer-loss": (
        False,
        "MindSpeed's fused DSA indexer loss (an NPU kernel)",
    ),
    "--use-sparse-flash-attn": (
        False,
        "MindSpeed's sparse flash attention for DSA (an NPU kernel): Megatron's DSA "
        "attention computes the same top-k attention unfused",
    ),
    "--enable-mla-absorb": (
        False,
        "MindSpeed's absorbed-MLA attention kernel (NPU): the same attention, computed "
        "without the absorption",
    ),
    "--mla-mm-split": (False, "MindSpeed's split MLA matmuls (an NPU layout)"),
    "--moe-alltoall-overlap-comm": (
        False,
        "MindSpeed's overlap of the MoE all-to-all with "
        "expert compute is not implemented by anyspeed (it needs "
        "CUDA streams): the all-to-all runs without overlap",
    ),
}


class AcceptedFlags(Feature):
    name = "accepted-flags"
    level = 0
    description = (
        "Megatron-LM / MindSpeed flags that change nothing on this device, accepted so launch "
        "scripts carry over (each listed with its reason)"
    )
    flags = tuple(NOOPS)

    def __init__(self, kernels: Sequence[Feature] = ()) -> None:
        self.kernels = tuple(kernels)  # level-1 features whose MindSpeed flags are noted here

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        for flag, (takes_value, _) in NOOPS.items():
            if takes_value == "+":
                add_flag(parser, flag, nargs="+", default=None, help=argparse.SUPPRESS)
            elif takes_value:
                add_flag(parser, flag, default=None, help=argparse.SUPPRESS)
            else:
                add_flag(parser, flag, action="store_true", help=argparse.SUPPRESS)

    def flag_notes(self) -> dict[str, str]:
        notes = {flag: why for flag, (_, why) in NOOPS.items()}
        for kernel in self.kernels:
            notes[kernel.flags[0]] = (
                f"not a no-op: switches on anyspeed's level-{kernel.level} {kernel.name} (on by "
                f"default at --optimization-level >= {kernel.level}; see its row)"
            )
        return notes
