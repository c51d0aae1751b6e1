"""``--stage dpo``, ``simpo`` and ``orm``: preference optimisation and an outcome reward model on
pairwise data."""
