"""Context parallelism in pure PyTorch: Ulysses (all-to-all) and ring attention (any device)."""
