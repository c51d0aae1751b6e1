"""Benchmarks for ``anyspeed evaluate``: readers of each data layout, prompts, scorers, and
the HumanEval executor."""
