"""Serving: the KServe model, its server process, generation, and the protocol client."""
