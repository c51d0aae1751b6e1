"""Inference on trained or converted models: full-vocabulary logits and text generation."""
