"""Which of Megatron-Core's unit tests cannot run without CUDA-only code, and why: the table
:mod:`anyspeed.testing.megatron` skips by, and the failure classes its summary uses. Each entry
names what the test needs; ``docs/megatron-tests.md`` lists them with the counts."""

from __future__ import annotations

import re

# Packages that exist for NVIDIA GPUs only: a test that fails importing one cannot run here.
CUDA_ONLY_MODULES = (
    "transformer_engine",
    "apex",
    "amp_C",
    "flash_attn",
    "flash_attn_3",
    "flashattn_hopper",
    "triton",
    "fused_layer_norm_cuda",
    "fused_weight_gradient_mlp_cuda",
    "grouped_gemm",
    "deep_ep",
    "nvshmem",
    "mamba_ssm",
    "causal_conv1d",
    "flashinfer",
    "cupy",
    "nvidia",
    "tensorrt_llm",
    "modelopt",
    "vllm",
    "nv_one_logger",
    "hybrid_ep",
    "cuda",
    "pynvml",
    "nvtx",
    "fla",
)

# (node-id pattern, reason): tests that need a CUDA feature anyspeed does not provide on
# other devices. Patterns are regular expressions matched at the start of the node id
# (relative to Megatron-LM's root).
TP = "tests/unit_tests/tensor_parallel/"
TR = "tests/unit_tests/transformer/"
TE_SPEC = "builds its model with the Transformer Engine layer spec (needs transformer_engine)"
TRITON = "runs a Triton GPU kernel (needs triton)"
ON_CUDA = (
    "asserts that a tensor sits on a CUDA device (the one line keeps it on this device; the "
    "module's math is covered by the file's other tests)"
)
CUDA_GRAPH_RNG = "needs CUDA graphs (graph-safe RNG: torch.cuda.CUDAGraph's generator registration)"
SKIPS: tuple[tuple[str, str], ...] = (
    (TP + r"test_random.py::test_double_fork_cuda_rng_states_tracker\[True\]", CUDA_GRAPH_RNG),
    (TP + r"test_random.py::test_convert_cuda_rng_state", CUDA_GRAPH_RNG),
    (
        TP + r"test_initialization.py::Test::test_(embedding|row|col)_init",
        "needs a device RNG apart from the CPU's (it reseeds the device RNG between two CPU-side "
        "initialisations; on the CPU both are one generator)",
    ),
    (r"[^:]+::(\w+::)?test_te_", "compares Transformer Engine layers (needs transformer_engine)"),
    (TR + r"moe/test_multihot_indices_converter.py::", TRITON + " (the fused indices converter)"),
    (TR + r"test_te_layers_batch_invariant.py::", TRITON + " (batch-invariant kernels)"),
    (r"[^:]+::\w+::test_gpu_forward", ON_CUDA),
    (TR + r"test_rope.py::TestMultimodalRotaryEmbedding::test_constructor", ON_CUDA),
    (
        TR + r"test_attention_variant_dsa.py::TestDSAIndexer",
        "builds the DSA indexer from TELinear and TENorm (needs transformer_engine)",
    ),
    (TR + r"test_transformer_block_custom_pgs.py::\w+::test_fwd_bwd_pass_non_uniform", TE_SPEC),
    (  # ids are [model-dst-src]: a TE spec on either side builds TELayerNormColumnParallelLinear
        r"tests/unit_tests/dist_checkpointing/models/test_t5_model.py::.*\[t5-(te-\w+|\w+-te)\]",
        TE_SPEC + " (T5's TE spec on the saving or the loading side)",
    ),
    (
        r"tests/unit_tests/dist_checkpointing/test_pipeline_parallel_layout.py::"
        r"test_save_and_load_checkpoint_vpp",
        TE_SPEC + " (the first case stops on TESpecProvider after initialising the micro-batch "
        "calculator: the next cases find it initialised)",
    ),
    (r"tests/unit_tests/models/test_t5_model.py::TestT5Model::", TE_SPEC + " (T5's TE blocks)"),
    (
        r"tests/unit_tests/data/test_fim_dataset.py::",
        "needs Megatron's test data in /opt/data (a tokenizer its conftest downloads; no network "
        "at run time here)",
    ),
    (r"tests/unit_tests/models/test_heterogeneous_gpt_model.py::", TE_SPEC),
    (
        r"tests/unit_tests/pipeline_parallel/test_pipeline_layout.py::test_forward_vpp",
        TE_SPEC + " (the first case fails on TENorm, before its cleanup: the next cases then find "
        "the micro-batch calculator initialised)",
    ),
)


def known_skip(nodeid: str) -> str | None:
    """The reason ``nodeid`` is skipped, or None."""
    for pattern, reason in SKIPS:
        if re.match(pattern, nodeid):
            return reason
    return None


def cuda_only_reason(exc: BaseException) -> str | None:
    """``needs <package> (CUDA-only)`` when ``exc`` (or what caused it) is an import of a
    CUDA-only package; None otherwise."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ImportError):
            name = (getattr(exc, "name", None) or "").split(".")[0]
            if not name:
                m = re.search(r"No module named '([\w]+)", str(exc))
                name = m.group(1) if m else ""
            if name in CUDA_ONLY_MODULES:
                return f"needs {name} (CUDA-only package, not installed)"
        if isinstance(exc, NameError) and re.match(r"TE[A-Z]", getattr(exc, "name", "") or ""):
            # Megatron's TE specs name TE classes that are only defined when TE imports
            return f"needs transformer_engine ({exc.name} is defined only with TE installed)"
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return None


# node-id pattern -> what a failure there is: a Megatron defect (with its upstream issue if
# one exists) or a test that assumes a CUDA device in a way the one line does not cover.
FAILURES: tuple[tuple[str, str], ...] = (
    (
        TR + r"moe/test_aux_loss.py::TestPaddingMaskAuxLoss::test_padding_mask_with_z_loss",
        "Megatron test assumption: torch.equal of bf16 router gradients from two batch shapes "
        "(32 tokens half padded vs the 16 real ones); the z-loss itself is equal (its assert "
        "passes), the bf16 sums differ in the last bit with the shape (CPU GEMM order)",
    ),
    (
        r"tests/unit_tests/dist_checkpointing/(test_global_metadata_reuse|test_nonpersistent|"
        r"test_optimizer)\.py::",
        "Megatron test defect off apex/TE: OptimizerConfig(lr=None), which FusedAdam accepts and "
        "Megatron's own torch fallback (torch.optim.Adam/AdamW) refuses: 'lr <= 0.0' TypeError",
    ),
    (
        r"tests/unit_tests/distributed/test_param_and_grad_buffer.py::test_grad_sync",
        "anyspeed by design: under gloo the distributed optimizer's reduce-scatter into a shard "
        "of the bucket is an in-place all-reduce (2.3x faster here), so the other shards hold "
        "reduced values too; the test asserts they are untouched (Megatron never reads them "
        "before zeroing)",
    ),
    (
        r"tests/unit_tests/dist_checkpointing/test_fully_parallel.py::\w+::test_memory_usage",
        "measures the CUDA allocator (torch.cuda.memory_allocated, within 4 MB); on the CPU the "
        "one line answers with the process's resident memory, which freed tensors leave late "
        "(measured 29 MB over)",
    ),
    (
        r"tests/unit_tests/dist_checkpointing/test_safe_globals.py::TestSafeGlobals::"
        r"test_safe_globals",
        "Megatron test-order dependency: the test never initialises torch.distributed; in "
        "Megatron's CI the dist_checkpointing bucket is one pytest session, where earlier files "
        "have. Run alone, every rank torch.saves into tmp_dist_ckpt, which the session fixture "
        "creates on rank 0 only ('Parent directory ... does not exist' on ranks 1-7); after one "
        "test that initialises it, both tests of the file pass on all 8 ranks",
    ),
    (
        r"tests/unit_tests/dist_checkpointing/test_serialization.py::TestSerialization::"
        r"test_remove_sharded_tensors",
        "Megatron vs the installed torch (2.13): remove_sharded_tensors renames "
        "FileSystemWriter.metadata_path, an attribute torch no longer has "
        "(_get_metadata_path()); Megatron's CI deselects this test (marked flaky and "
        "flaky_in_dev)",
    ),
    (
        r"tests/unit_tests/dist_checkpointing/test_serialization.py::TestNonStrictLoad::"
        r"test_missing_keys_raises_error_during_validation",
        "pytest version: Megatron pins pytest 8.3.5; this environment's pytest 9 attaches "
        "caplog to non-propagating loggers too, so torch's dcp_logger DEBUG records land in "
        "caplog.text, which the test asserts is empty",
    ),
    (
        r"tests/unit_tests/distributed/megatron_fsdp/.*test_fsdp_user_buffer_registration",
        "CUDA/NCCL only: NCCL user-buffer registration (megatron/core/build/nccl_allocator.so)",
    ),
)


def explain_failure(nodeid: str) -> str:
    """The class of a failure at ``nodeid``: the table's, else ``unexplained``."""
    for pattern, what in FAILURES:
        if re.match(pattern, nodeid):
            return what
    return "unexplained"
