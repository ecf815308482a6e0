"""serve stage."""
