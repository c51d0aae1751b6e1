"""Portable operator modules that plug into Megatron's ModuleSpec seams."""
