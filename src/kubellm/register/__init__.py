"""register stage."""
