"""What the colocated RL stages share (GRPO, PPO): prompt data, rule rewards, the rollout and
its micro-batches, the policy objective (token or sequence ratios, KL, entropy, aggregation),
rollout correction, the flags and checks, and the policy task the stages specialise."""
