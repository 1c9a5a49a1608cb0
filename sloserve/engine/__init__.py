"""sloserve.engine."""
