"""Parallel-layout checks shared by the adaptor, the Megatron-LM hooks and the engine.

Each problem is one ValueError line naming the flag and what would fix it, raised before any
process group exists (a bad layout otherwise surfaces as a hang or a deep assertion).
"""

from __future__ import annotations


def check_layout(
    *,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_algo: str = "p2p",
    seq_length: int | None = None,
    ulysses_degree: int | None = None,
) -> None:
    """Raise ValueError (one line) when the layout cannot work on ``world_size`` processes."""
    if tp < 1 or pp < 1:
        raise ValueError(
            "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1"
        )
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = "
            f"{tp * pp * cp}: change the sizes or the number of processes"
        )
    if cp > 1 and seq_length is not None:
        need = 2 * cp  # Megatron's load-balanced split: two chunks per CP rank
        if seq_length % need:
            raise ValueError(
                f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size "
                f"{cp} = {need}"
            )
    if cp > 1 and cp_algo == "a2a+p2p":
        if not ulysses_degree or ulysses_degree < 1 or cp % ulysses_degree:
            raise ValueError(
                f"--context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp dividing "
                f"--context-parallel-size {cp} (got {ulysses_degree})"
            )
    degree = cp if cp_algo == "a2a" else (ulysses_degree or 1) if cp_algo == "a2a+p2p" else 1
    if cp > 1 and degree > 1 and num_attention_heads is not None:
        if num_attention_heads % (tp * degree):
            raise ValueError(
                f"--num-attention-heads {num_attention_heads} is not divisible by the Ulysses "
                f"degree {degree} x --tensor-model-parallel-size {tp}"
            )
    if num_attention_heads is not None and num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if num_query_groups and num_query_groups % tp and tp % num_query_groups:
        raise ValueError(
            f"--num-query-groups {num_query_groups} and --tensor-model-parallel-size {tp} must "
            "divide one another"
        )
    chunks = pp * (vpp or 1)
    if num_layers is not None and num_layers % chunks:
        raise ValueError(
            f"--num-layers {num_layers} is not divisible by pipeline stages x virtual chunks = "
            f"{chunks}"
        )
    if sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if vpp and vpp > 1 and pp < 2:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size >= 2")
