"""Fakes for what cannot run in tests; each says what it stands in for."""
