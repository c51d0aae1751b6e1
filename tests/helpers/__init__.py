"""Helpers shared by the test areas (corpora, tokenizers, functions spawned ranks run)."""
