"""``--stage grpo``: colocated GRPO with DAPO's and GSPO's options, the shared RL machinery of
:mod:`anyspeed.stages.common.rl` with group-normalised advantages."""
