"""Level-1 feature ``no-grad-fast-path``: Megatron's forward without training-only work."""
