"""Data: sources, cleaning, dedup, tokenization, packing, and the Dataset artifact."""
