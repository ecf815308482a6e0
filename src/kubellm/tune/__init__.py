"""Hyperparameter search: the search space and trial vocabulary (tuners live in backends)."""
