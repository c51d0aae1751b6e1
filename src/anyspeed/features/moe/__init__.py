"""Mixture-of-Experts features: Megatron's MoE layers made to run on every device."""
