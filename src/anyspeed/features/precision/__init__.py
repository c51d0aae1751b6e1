"""Precision memory features: how master weights are held next to low-precision weights."""
