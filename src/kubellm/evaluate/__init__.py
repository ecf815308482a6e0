"""Held-out evaluation: loss, perplexity and task metrics of a model directory."""
