"""Level-2 memory features (MindSpeed's second family): recompute variants, activation swap,
optimizer offload flags, and the saved-activation bytes meter they are measured with."""
