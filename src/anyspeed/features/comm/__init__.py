"""Collectives rewritten for a backend: ``feature`` wires them, ``gloo_collectives`` holds them."""
