"""Process-level facilities below everything that trains or infers: the process group and
Megatron's parallel state for a layout, rank-0 printing and agreement across ranks, a second
parallel state entered explicitly (a rollout's or a critic's layout), and resharding: the one
definition of how tensor- and expert-parallel shards join and split, which the checkpoint
converter and the rollouts both use."""
